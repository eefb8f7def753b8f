"""Branch runs from common checkpoints, continue each in several arithmetics, compare them in pairs.

    .venv/bin/python tools/branch.py --base grids/decide/cartpole_swingup/fp32/s1 --modes fp16,fp32 \\
        --continuations 1,2,3 --frames 20000 --out branches/s1_40k --jobs 2
    .venv/bin/python tools/branch.py --out branches/s1_40k --collect-only

Each ``--base`` is an fp32 run directory (its ``checkpoints/last.ckpt`` with its replay file) or a
``last.ckpt``. For every base, mode and continuation seed ``c`` the tool writes a branch run
``OUT/<base label>/<mode>/c<c>``: the base's checkpoint converted to the mode
(:func:`pixelsac.branching.branch_checkpoint`: exact, refused in one line where it cannot be) with
the random streams of continuation ``c`` -- the same for every mode, so the arms of one pair differ
only in arithmetic -- its replay file linked beside it, and ``branch.json`` saying what it came from.
Then ``python -m pixelsac.train resume=BRANCH train.env_frames=<base frames + --frames>`` continues
it (with this checkout's code, ``train.num_threads=1`` unless overridden; other ``key=value``
arguments go to every continuation). Running the same command again continues what is unfinished.

``--q-scale C`` continues every branch in larger returns' units: rewards, temperature and Q ×C,
Adam's moments in the gradients' new units (:func:`pixelsac.branching.scaled_returns`), so a
CPU's batch-32 base reaches the critic gradients of Q in the hundreds; returns are still reported
in the task's units. Each Q scale needs its own ``--out``.

A branch's score is the mean of its evaluation returns after the branch point (the base's
evaluation schedule continues: with ``--frames 20000`` and evaluations every 10k, at +10k and
+20k). Pairs are (base, continuation): each mode against ``--against`` (fp32). The verdict follows
tools/verdict.py's rule over the pairs, and over base means once there are 3 or more bases (the
verdict from ``--verdict-bases`` bases on, an interim reading below that). Only the verdict's line
says "matches", "lags" or "leads"; an interim reading, and the pairs once the bases decide, give
the same figures without the word.
Writes ``OUT/branches.csv`` (every branch's evaluations), ``OUT/paired.csv``, ``OUT/results.md`` and
``OUT/curves.png`` (a panel per base: its curve to the branch point, then every finished arm).
One process writes an ``--out`` folder at a time: a command that trains or names ``--base`` holds a
lock on it (``OUT/.lock``) to its end, and a second one is refused in one line naming the first; a
bare ``--collect-only`` reads the plan and rewrites only the summary files, so it takes no lock and
can look at an experiment while it runs.
Bad arguments and unconvertible checkpoints: one ``error:`` line, exit 2; exit 1 when a continuation
failed (see its train.log).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
for path in (REPO, TOOLS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import plot  # noqa: E402
from experiment import checkpoint_frames  # noqa: E402
from verdict import interim, paired_verdict  # noqa: E402

from pixelsac import checkpoint as ckpt  # noqa: E402
from pixelsac import files  # noqa: E402
from pixelsac.branching import BRANCH_PRECISIONS, branch_checkpoint  # noqa: E402
from pixelsac.cli import UsageError  # noqa: E402
from pixelsac.provenance import git_state  # noqa: E402
from pixelsac.rundir import RunDirLock  # noqa: E402


class BranchError(ValueError):
    """Bad arguments or a base that cannot branch: one line, exit 2."""


@dataclass
class Base:
    label: str
    file: Path  # its last.ckpt
    env_frames: int


@dataclass
class Branch:
    base: Base
    mode: str
    continuation: int
    run_dir: Path
    q_scale: float = 1.0  # Q values ×q_scale (pixelsac.branching.scaled_returns); 1 = the base's units

    @property
    def key(self) -> str:
        return f"{self.base.label}/{self.mode}/c{self.continuation}"


@functools.cache
def loaded_base(file: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A base's checkpoint and the replay files it names (checked), read once per process
    however many branches start from it."""
    try:
        checkpoint = ckpt.load(file, prefer="last")
        return checkpoint, tuple(ckpt.check_resumable(file, checkpoint))
    except ckpt.CheckpointError as exc:
        raise BranchError(f"{file}: {exc}") from exc


def resolve_base(text: str) -> Base:
    """A base from a run directory or a checkpoint file; label ``<run folder>_<k>k``."""
    path = Path(text)
    try:
        file = ckpt.resolve(path, prefer="last")
    except ckpt.CheckpointError as exc:
        raise BranchError(str(exc)) from exc
    if file.name != "last.ckpt":
        raise BranchError(f"{file}: branch from a last.ckpt (it has the replay file); best.ckpt has none")
    run_dir = file.parent.parent if file.parent.name == "checkpoints" else file.parent
    checkpoint, _ = loaded_base(file)
    frames = ckpt.saved_counters(checkpoint)["env_frames"]
    if frames is None:
        raise BranchError(f"{file} does not record its env frames; it cannot be a base")
    name = "_".join(part for part in run_dir.parts[-3:] if part not in ("/",))
    at = f"{frames // 1000}k" if frames % 1000 == 0 else str(frames)
    return Base(f"{name}_{at}", file, int(frames))


def write_branch(branch: Branch) -> dict[str, Any]:
    """Convert the base into the branch's run directory (nothing written when conversion fails)."""
    checkpoint, replays = loaded_base(branch.base.file)
    try:
        converted = branch_checkpoint(checkpoint, branch.mode, branch.continuation, branch.q_scale)
    except ckpt.CheckpointError as exc:
        raise BranchError(f"{branch.base.file}: {exc}") from exc
    folder = branch.run_dir / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    for name in replays:
        source, target = branch.base.file.parent / name, folder / name
        if not target.exists():
            try:
                os.link(source, target)
            except OSError:  # another filesystem
                shutil.copy2(source, target)
    buffer = io.BytesIO()
    import torch

    torch.save(converted, buffer)
    files.write_atomically(folder / "last.ckpt", buffer.getvalue())
    commit, changed = git_state(REPO)
    record = {
        "base": str(branch.base.file),
        "base_env_frames": branch.base.env_frames,
        "mode": branch.mode,
        "continuation": branch.continuation,
        "q_scale": branch.q_scale,
        "loss_scales": {k: v["scale"] for k, v in converted["pixelsac"].get("scalers", {}).items()},
        "code": (commit or "unknown")[:7] + (" + uncommitted changes" if changed else ""),
    }
    files.write_atomically(branch.run_dir / "branch.json", json.dumps(record, indent=2) + "\n")
    return record


def continue_branch(branch: Branch, budget: int, overrides: Sequence[str]) -> tuple[str, int]:
    """Write the branch when new, then train it to ``budget`` env frames; (status, exit code)."""
    frames = checkpoint_frames(branch.run_dir)
    if frames is not None and frames >= budget:
        return "done", 0
    if frames is None:
        write_branch(branch)
    threads = [] if any(o.startswith("train.num_threads=") for o in overrides) else ["train.num_threads=1"]
    command = [
        sys.executable,
        "-m",
        "pixelsac.train",
        f"resume={branch.run_dir}",
        f"train.env_frames={budget}",
        *threads,
        *overrides,
    ]
    env = {
        **os.environ,
        "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with open(branch.run_dir / "train.log", "a") as log:
        log.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} {shlex.join(command)}\n")
        log.flush()
        rc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return ("ok" if rc == 0 else "stopped" if rc == 75 else "failed"), rc


# --- results ---------------------------------------------------------------------------------------
def branch_evaluations(branch: Branch) -> tuple[list[int], list[float]]:
    """Evaluations after the branch point (frames, returns)."""
    try:
        frames, returns = plot.read_eval_curve(branch.run_dir)
    except plot.PlotError:
        return [], []
    keep = frames > branch.base.env_frames
    return [int(f) for f in frames[keep]], [float(r) for r in returns[keep]]


def collect(branches: Sequence[Branch], frames: int, against: str, out: Path, verdict_bases: int = 3) -> str:
    """Write branches.csv, paired.csv and results.md; return the markdown. The base-level reading
    is the verdict from ``verdict_bases`` bases on; with fewer (and at least 3) it is interim."""
    scores: dict[tuple[str, str, int], float] = {}
    evaluations = {branch.key: branch_evaluations(branch) for branch in branches}  # read once: table and plot
    with open(out / "branches.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["base", "mode", "continuation", "env_frames", "eval_return"])
        for branch in branches:
            at, returns = evaluations[branch.key]
            for frame, value in zip(at, returns):
                writer.writerow([branch.base.label, branch.mode, branch.continuation, frame, f"{value:.3f}"])
            if at and at[-1] >= branch.base.env_frames + frames:
                scores[(branch.base.label, branch.mode, branch.continuation)] = float(np.mean(returns))
    modes = sorted({b.mode for b in branches} - {against})
    lines = [
        f"# Branches: {frames:,} env frames from common checkpoints, each mode against {against}",
        "",
        "Score of a branch: the mean of its evaluation returns after the branch point. Pairs: (base, continuation).",
        "",
    ]
    q_scales = sorted({b.q_scale for b in branches})
    if q_scales != [1.0]:
        lines += [
            f"Continued with rewards, temperature and Q ×{', '.join(f'{q:g}' for q in q_scales)} (--q-scale); "
            "returns in the task's units.",
            "",
        ]
    with open(out / "paired.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["base", "continuation", "mode", "score", against, "difference"])
        for mode in modes:
            pairs = []
            for (label, m, c), score in sorted(scores.items()):
                if m == mode and (label, against, c) in scores:
                    pairs.append((label, c, score, scores[(label, against, c)]))
            for label, c, a, b in pairs:
                writer.writerow([label, c, mode, f"{a:.3f}", f"{b:.3f}", f"{a - b:.3f}"])
            reference = float(np.mean([p[3] for p in pairs])) if pairs else 0.0
            labels = sorted({p[0] for p in pairs})
            # the rule decides by base once there are 3 bases, and only from verdict_bases on;
            # a reading that is not the verdict carries no "matches" or "lags"
            by_pair_decides = len(labels) < 3 and len(labels) >= verdict_bases
            verdict = paired_verdict([a - b for _, _, a, b in pairs], reference)
            if by_pair_decides:
                pair_status = ""
            elif len(labels) >= 3:
                pair_status = " (not the verdict: pairs that share a base are not independent)"
            else:
                pair_status = f" ({interim(len(labels), verdict_bases, 'bases')})"
            pair_line = verdict.sentence(f"{mode} - {against}", decides=by_pair_decides)
            lines += [f"## {mode} against {against}", "", f"**By pair{pair_status}: {pair_line}**", ""]
            if len(labels) >= 3:
                by_base = [np.mean([a - b for lab, _, a, b in pairs if lab == label]) for label in labels]
                decides = len(labels) >= verdict_bases
                base_verdict = paired_verdict(by_base, reference).sentence(
                    f"{mode} - {against}", units="bases", decides=decides
                )
                status = (
                    "the verdict" if decides else f"{interim(len(labels), verdict_bases, 'bases')}; decides nothing"
                )
                lines += [f"**By base ({status}): {base_verdict}**", ""]
            lines += [f"| base | continuation | {mode} | {against} | difference |", "|---|---|---|---|---|"]
            lines += [f"| {lab} | {c} | {a:.1f} | {b:.1f} | {a - b:+.1f} |" for lab, c, a, b in pairs]
            lines.append("")
    unscored = [b for b in branches if (b.base.label, b.mode, b.continuation) not in scores]
    # continue_branch writes train.log before training starts; converting alone writes none
    running = [b.key for b in unscored if (b.run_dir / "train.log").is_file()]
    unstarted = [b.key for b in unscored if b.key not in running]
    if running:
        lines += ["Started, not finished: " + ", ".join(running), ""]
    if unstarted:
        lines += ["Not started: " + ", ".join(unstarted), ""]
    if scores:
        plot_branches(branches, evaluations, scores, against, out / "curves.png")
        lines += [
            "![Each base's returns to the branch point, then every arm of every continuation](curves.png)",
            "",
        ]
    text = "\n".join(lines)
    (out / "results.md").write_text(text)
    return text


def plot_branches(
    branches: Sequence[Branch],
    evaluations: dict[str, tuple[list[int], list[float]]],
    scores: dict[tuple[str, str, int], float],
    against: str,
    out: Path,
) -> None:
    """One panel per base: the base run's evaluation returns up to the branch point (grey), then
    each finished branch from there, a colour per mode and a line style per continuation; the
    panel's title gives each pair's score difference."""
    finished = [b for b in branches if (b.base.label, b.mode, b.continuation) in scores]
    bases = sorted({b.base.label: b.base for b in finished}.values(), key=lambda base: base.label)
    fig, axes, colors = plot.panels(len(bases), sorted({b.mode for b in branches}))
    styles = ("-", "--", ":", "-.")
    for ax, base in zip(axes, bases):
        base_dir = base.file.parent.parent if base.file.parent.name == "checkpoints" else base.file.parent
        try:
            frames, returns = plot.read_eval_curve(base_dir)
            keep = frames <= base.env_frames
            ax.plot(frames[keep], returns[keep], color="0.5", lw=1.8, label=f"base ({against})")
            start = float(returns[keep][-1]) if keep.any() else None
        except plot.PlotError:  # the base's files are elsewhere: the branches alone
            start = None
        differences = []
        for branch in (b for b in finished if b.base.label == base.label):
            at, values = evaluations[branch.key]
            if start is not None:
                at, values = [base.env_frames, *at], [start, *values]
            style = styles[(branch.continuation - 1) % len(styles)]
            ax.plot(
                at, values, color=colors[branch.mode], ls=style, lw=1.4, label=f"{branch.mode} c{branch.continuation}"
            )
            key = (base.label, against, branch.continuation)
            if branch.mode != against and key in scores:
                own = scores[(base.label, branch.mode, branch.continuation)]
                differences.append(f"c{branch.continuation} {own - scores[key]:+.1f}")
        ax.axvline(base.env_frames, color="0.8", lw=0.8)
        ax.set_title(f"{base.label}: " + ", ".join(differences), fontsize=9)
        ax.set_xlabel("env frames")
        ax.set_ylabel("eval return")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    plot.save_figure(fig, [out], dpi=110)


# --- command line ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every continuation")
    parser.add_argument("--out", type=Path, required=True, help="branch folder (OUT/<base>/<mode>/c<seed>)")
    parser.add_argument("--base", action="append", default=[], help="an fp32 run directory or last.ckpt (repeatable)")
    parser.add_argument("--modes", default="fp16,fp32", help=f"modes to continue in: {', '.join(BRANCH_PRECISIONS)}")
    parser.add_argument("--continuations", default="1,2,3", help="continuation seeds")
    parser.add_argument("--frames", type=int, default=20_000, help="env frames each continuation trains")
    parser.add_argument("--against", default="fp32", help="the mode every other mode is paired with")
    parser.add_argument("--jobs", type=int, default=1, help="continuations at once")
    parser.add_argument(
        "--verdict-bases",
        type=int,
        default=None,
        help="bases at which the base-level reading is the verdict (fewer: interim; default 3, or the plan's)",
    )
    parser.add_argument(
        "--q-scale",
        type=float,
        default=1.0,
        help="continue with rewards, temperature and Q values x this (larger returns' gradients; default 1)",
    )
    parser.add_argument("--collect-only", action="store_true", help="only (re)write the results")
    return parser.parse_args(argv)


def plan(args: argparse.Namespace, locks: list[RunDirLock]) -> tuple[list[Branch], int]:
    """The branches of the command line, or of ``OUT/plan.json`` (written at the first start).
    A command that writes the plan or trains locks ``OUT`` first (added to ``locks``, which the
    caller releases), so the plan it reads is the one it runs."""
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in BRANCH_PRECISIONS:
            raise BranchError(f"--modes: a branch continues in {', '.join(BRANCH_PRECISIONS)}, not {mode!r}")
    try:
        continuations = [int(c) for c in args.continuations.split(",") if c]
    except ValueError:
        raise BranchError(f"--continuations takes comma-separated integers, got {args.continuations!r}") from None
    if args.frames <= 0 or args.jobs <= 0:
        raise BranchError("--frames and --jobs must be positive")
    if not (np.isfinite(args.q_scale) and args.q_scale > 0):
        raise BranchError(f"--q-scale must be a finite number above 0, got {args.q_scale}")
    if args.verdict_bases is not None and args.verdict_bases < 3:
        raise BranchError(f"--verdict-bases: a base-level verdict needs 3 bases or more, got {args.verdict_bases}")
    for override in args.overrides:
        if "=" not in override:
            raise BranchError(f"{override!r} is not a key=value override")
    saved = args.out / "plan.json"
    bases = [resolve_base(b) for b in args.base]
    if not bases and not saved.is_file():
        raise BranchError(f"no --base given and {saved} does not exist: name the runs to branch from")
    if bases or not args.collect_only:
        locks.append(RunDirLock(args.out, key="--out").acquire())  # a UsageError names the holder
    if not bases:
        record = json.loads(saved.read_text())
        bases = [Base(b["label"], Path(b["file"]), int(b["env_frames"])) for b in record["bases"]]
        modes, continuations, args.frames = record["modes"], record["continuations"], int(record["frames"])
        args.q_scale = float(record.get("q_scale", 1.0))
        if args.verdict_bases is None:
            args.verdict_bases = int(record.get("verdict_bases", 3))
    else:
        planned_q_scale = float(json.loads(saved.read_text()).get("q_scale", 1.0)) if saved.is_file() else args.q_scale
        if planned_q_scale != args.q_scale:
            raise BranchError(
                f"{args.out} holds branches at --q-scale {planned_q_scale:g}; give each Q scale its own --out"
            )
        if args.verdict_bases is None:
            args.verdict_bases = 3
        args.out.mkdir(parents=True, exist_ok=True)
        record = {
            "bases": [{"label": b.label, "file": str(b.file), "env_frames": b.env_frames} for b in bases],
            "modes": modes,
            "continuations": continuations,
            "frames": args.frames,
            "verdict_bases": args.verdict_bases,
            "q_scale": args.q_scale,
        }
        files.write_atomically(saved, json.dumps(record, indent=2) + "\n")
    branches = [
        Branch(base, mode, c, args.out / base.label / mode / f"c{c}", args.q_scale)
        for base in bases
        for c in continuations
        for mode in modes
    ]
    return branches, args.frames


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    locks: list[RunDirLock] = []
    try:
        return branch_and_collect(args, locks)
    except (BranchError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        for lock in locks:
            lock.release()


def branch_and_collect(args: argparse.Namespace, locks: list[RunDirLock]) -> int:
    branches, frames = plan(args, locks)
    if not args.collect_only:
        for branch in branches:  # refuse an unconvertible base before anything trains
            if checkpoint_frames(branch.run_dir) is None:
                write_branch(branch)
    failed = False
    if not args.collect_only:

        def run(branch: Branch) -> None:
            nonlocal failed
            status, rc = continue_branch(branch, branch.base.env_frames + frames, args.overrides)
            failed |= status == "failed"
            print(f"{status:<8} {branch.key} (exit {rc}; log {branch.run_dir / 'train.log'})", flush=True)

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(run, branches))
    print(collect(branches, frames, args.against, args.out, args.verdict_bases), end="")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
