"""Evaluate a trained agent from a checkpoint: returns, a results file and videos::

    pixelsac-evaluate checkpoint=runs/cheetah_run/20260101-120000_fp16_s1
    pixelsac-evaluate checkpoint=run/checkpoints/last.ckpt episodes=20 video=false
    pixelsac-evaluate checkpoint=RUN video_episodes=all agent_view=true out_dir=eval/

Options are ``key=value``; ``conf/evaluate.yaml`` lists each with its default and meaning
(``--help`` prints it). The first episode is filmed unless ``video=false``.

Checkpoints of any precision (fp32, fp16, bf16, amp), written on a GPU or a CPU, evaluate on
either device. A bad option or an unusable checkpoint is reported in one line with exit code 2,
before anything is written.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pixelsac import cli, files, rundir
from pixelsac.checkpoint import CheckpointError
from pixelsac.cli import UsageError
from pixelsac.config import REPORT_SEED_OFFSET, ConfigError, load_options, option_lines


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """What ``python -m pixelsac.evaluate`` was asked to do (see the module docstring)."""

    checkpoint: str
    prefer: str = "best"
    episodes: int = 10
    seed: int | None = None
    sample: bool = False
    video: bool = True  # the point of evaluating a checkpoint is usually to watch it
    video_episodes: tuple[int, ...] | None = (0,)  # None: every episode
    video_size: int = 256
    video_camera: int | None = None
    agent_view: bool = False
    out_dir: str | None = None
    overwrite: bool = False
    device: str = "auto"
    trust_checkpoint: bool = False
    arithmetic: str = "trained"  # trained | fp32 | fp64: the dtype the policy acts in


USAGE = (
    (__doc__ or "")
    + "\noptions (conf/evaluate.yaml: name, default, meaning):\n"
    + "\n".join(f"  {line}" for line in option_lines("evaluate").values())
)


#: options that only make sense with video=true
_VIDEO_OPTIONS = ("video_episodes", "video_size", "video_camera", "agent_view")


def parse_options(argv: Sequence[str]) -> EvalOptions:
    """Turn ``key=value`` arguments into :class:`EvalOptions`: ``conf/evaluate.yaml`` holds each
    option's default, :func:`pixelsac.config.load_options` checks names, types and bounds;
    :class:`ConfigError` on a mistake."""
    values = load_options(
        "evaluate",
        argv,
        nullable={"checkpoint": str, "seed": int, "video_camera": int, "out_dir": str},
        lower_bounds={"episodes": 1, "video_size": 1, "seed": 0, "video_camera": 0},
        choices={"prefer": ("best", "last"), "arithmetic": ("trained", "fp32", "fp64")},
        verbatim=("checkpoint", "out_dir", "device"),  # paths and names keep their text
        untyped=("video_episodes",),
    )
    if values["checkpoint"] is None:
        raise ConfigError("checkpoint=PATH is required (a .ckpt file or a run directory)")
    cli.check_device_name(values["device"])
    named = {item.partition("=")[0].strip() for item in argv}  # load_options checked them
    video_options = [key for key in _VIDEO_OPTIONS if key in named]
    if video_options and not values["video"]:  # the default is true: false was asked for
        raise ConfigError(f"video=false contradicts {', '.join(video_options)}; drop one of them")
    values["video_episodes"] = _episode_list(values["video_episodes"], str(values["video_episodes"]))
    options = EvalOptions(**values)
    if options.video_episodes is not None:
        beyond = [e for e in options.video_episodes if e >= options.episodes]
        if beyond:
            raise ConfigError(
                f"video_episodes {beyond} do not exist: episodes=... plays "
                f"{options.episodes} episode(s), numbered 0..{options.episodes - 1}"
            )
    return options


def _episode_list(value: Any, raw: str) -> tuple[int, ...] | None:
    """``0`` / ``0,1`` / ``[0, 1]`` / ``all`` -> episode indices (None: all)."""
    if value == "all":
        return None
    items = value if isinstance(value, list) else [value] if isinstance(value, int) else str(raw).split(",")
    try:
        indices = [int(str(item).strip()) for item in items]
    except ValueError:
        indices = [-1]
    if not indices or any(i < 0 for i in indices):
        raise ConfigError(f"video_episodes={raw!r}; give episode numbers from 0 (e.g. 0,1) or all")
    return tuple(sorted(set(indices)))


# --- loading and checking a checkpoint ------------------------------------------------------------
def load_agent(checkpoint_file: Path, checkpoint: dict[str, Any], device: Any, arithmetic: str = "trained") -> Any:
    """The checkpoint's SACModule, in eval mode on ``device``, with its precision policy resolved
    for that device (a run trained on a GPU evaluated on a CPU gets the CPU's compute path) and
    that policy's process-wide numerics set (TF32 only with ``perf.tf32``), as in training.

    ``arithmetic`` ``"fp32"`` or ``"fp64"``: the same weights widened exactly to that dtype (every
    fp16, bf16 and fp32 value is one in float32 and float64), acting without the 16-bit
    emulation (:meth:`pixelsac.precision.PrecisionPolicy.widened`): whatever differs from
    ``"trained"`` is the acting arithmetic's, not the weights'."""

    from pixelsac.module import SACModule
    from pixelsac.precision import nonfinite_names

    non_finite = nonfinite_names(checkpoint["state_dict"])
    if non_finite:
        raise CheckpointError(
            f"{checkpoint_file} holds non-finite weights ({len(non_finite)} tensors, "
            f"e.g. {non_finite[0]}): the run diverged before it was saved"
        )
    try:
        module = SACModule.from_checkpoint(checkpoint)
    except CheckpointError:
        raise
    except (KeyError, AttributeError, TypeError, ValueError) as exc:  # a config this version cannot read
        raise CheckpointError(
            f"{checkpoint_file} describes an agent this pixelsac cannot build "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc
    module = module.to(device)
    # as in training (SACModule.setup): IEEE fp32 on CUDA unless perf.tf32, split-K and the layout
    # of the device, so the evaluation's forward pass is the one act() ran in training
    module.use_device(device.type)
    if arithmetic != "trained":
        module.precision_policy = module.precision_policy.widened(arithmetic)
        module.precision_policy.apply_global_numerics()
        module.precision_policy.configure_split_k(module)  # no split-K in a wide dtype
        module = module.to(module.precision_policy.param_dtype)
    return module.eval()


def make_env(config: dict[str, Any], seed: int) -> Any:
    """The environment a checkpoint was trained on, built from the config it stores."""
    try:
        return cli.env_from_config(config, seed)
    except (ConfigError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the checkpoint's config has no usable env settings ({exc})") from exc


def default_out_dir(checkpoint_file: Path, now: datetime.datetime | None = None) -> Path:
    """Create and return ``<run dir>/eval/<stem>-<date>-<time>`` for a checkpoint inside a run's
    ``checkpoints/``, else ``eval/<stem>-<date>-<time>`` beside the checkpoint file; ``-2``,
    ``-3``... after the time when that folder exists. Created exclusively (``mkdir``), so two
    evaluations started in the same second never share one. An ``eval`` that is a link (or not a
    folder) is refused: the results would go wherever it points."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    eval_root = run_dir_of(checkpoint_file) / "eval"
    _refuse_link(eval_root, "eval")
    eval_root.mkdir(parents=True, exist_ok=True)
    _refuse_link(eval_root, "eval")  # made a link meanwhile
    suffix = 1
    while True:
        out_dir = eval_root / (f"{checkpoint_file.stem}-{stamp}" + (f"-{suffix}" if suffix > 1 else ""))
        try:
            out_dir.mkdir()
            return out_dir
        except FileExistsError:  # another evaluation in the same second (or a link of that name)
            suffix += 1


def run_dir_of(checkpoint_file: Path) -> Path:
    """The run directory of a checkpoint in its ``checkpoints/``, else the checkpoint's folder."""
    parent = checkpoint_file.parent
    return parent.parent if parent.name == "checkpoints" else parent


def _refuse_link(path: Path, what: str) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        target = f" (to {os.readlink(path)})" if path.is_symlink() else ""
        raise UsageError(
            f"{path} is {'a symbolic link' + target if path.is_symlink() else 'not a folder'}, where an "
            f"evaluation writes its {what} folder; remove it, or choose out_dir=..."
        )


# --- running --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Evaluation:
    """What one evaluation produced."""

    out_dir: Path
    results: dict[str, Any]
    videos: list[Path]


class _LengthCounter:
    """``on_frame`` hook counting agent steps per episode (run_episodes reports returns only)."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}

    def __call__(self, episode: int, env: Any) -> None:
        self.calls[episode] = self.calls.get(episode, 0) + 1

    def length(self, episode: int) -> int:
        return self.calls.get(episode, 1) - 1  # the first call is the reset, not a step


def evaluate(options: EvalOptions, out: Callable[[str], None] = print) -> Evaluation:
    """Load, check, play and record; writes ``results.json`` (and videos) into the out dir.

    Everything that can be refused (options, checkpoint, environment, video size) is checked
    before the out dir is created. Raises ConfigError, CheckpointError or EnvError.
    """
    import torch

    from pixelsac.checkpoint import load, resolve, saved_counters
    from pixelsac.collect import run_episodes
    from pixelsac.envs.dmc import select_egl_device
    from pixelsac.video import EpisodeRecorder

    device = cli.resolve_device(options.device)
    if device.type == "cuda":  # render on the GPU that runs the agent (before dm_control loads)
        select_egl_device(device.index if device.index is not None else torch.cuda.current_device())
    checkpoint_file = resolve(options.checkpoint, options.prefer).resolve()
    checkpoint = load(checkpoint_file, map_location="cpu", trust=options.trust_checkpoint)
    config = checkpoint["hyper_parameters"]["config"]
    module = load_agent(checkpoint_file, checkpoint, device, options.arithmetic)
    seed = options.seed if options.seed is not None else int(config.get("seed", 0)) + REPORT_SEED_OFFSET
    env = make_env(config, seed)
    lock: rundir.RunDirLock | None = None  # on the output folder, from its creation to results.json
    try:
        if tuple(env.obs_shape) != tuple(module.obs_shape) or env.action_dim != module.action_dim:
            raise CheckpointError(
                f"the checkpoint's networks take observations {tuple(module.obs_shape)} and "
                f"{module.action_dim} actions, but its config builds {tuple(env.obs_shape)} "
                f"and {env.action_dim}"
            )
        env.reset()  # renders: a missing OpenGL library is reported now, before anything is written
        if options.video:
            if options.agent_view and env.obs_kind != "pixels":
                raise ConfigError("agent_view=true needs a policy trained from pixels; this one sees states")
            env.render(options.video_size, options.video_camera)  # checks size and camera
        lock = _claim_out_dir(options, checkpoint_file, out)
        out_dir = lock.run_dir
        counters = saved_counters(checkpoint)
        out(f"checkpoint {checkpoint_file}")
        out(
            f"  {config['task']}, {module.precision_policy.describe()}; "
            f"{_count(counters['env_frames'])} env frames, {_count(counters['updates'])} updates; on {device}"
        )
        out(
            f"  {options.episodes} episode(s), seed {seed}, "
            f"{'sampled' if options.sample else 'deterministic (mean)'} actions"
        )

        torch.manual_seed(seed)  # only sample=true draws random numbers
        start = time.perf_counter()
        returns, lengths, videos = [], [], []
        out(f"{'episode':>8}  {'return':>9}  {'length':>6}")
        for index in range(options.episodes):
            counter = _LengthCounter()
            filming = options.video and (options.video_episodes is None or index in options.video_episodes)
            recorder = (
                EpisodeRecorder(options.video_size, options.video_camera, options.agent_view, episodes={0})
                if filming
                else None
            )
            # One run_episodes call per episode: episodes follow each other on the same env exactly
            # as in one call, but each video is written (and its frames freed) as soon as it ends.
            hook = counter if recorder is None else _both(counter, recorder)
            [episode_return] = run_episodes(env, module.act, 1, sample=options.sample, on_frame=hook)
            returns.append(float(episode_return))
            lengths.append(counter.length(0))
            if recorder is not None:
                videos.append(recorder.save(out_dir / f"episode_{index:03d}.mp4"))
            out(f"{index:>8}  {returns[-1]:>9.2f}  {lengths[-1]:>6}")
        wall_seconds = time.perf_counter() - start
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    finally:
        env.close()

    try:
        results = _results(
            options,
            checkpoint_file,
            config,
            module,
            counters,
            seed,
            returns,
            lengths,
            videos,
            out_dir,
            wall_seconds,
            env.action_repeat,
            device,
        )
        files.write_atomically(out_dir / "results.json", json.dumps(results, indent=2) + "\n")
    finally:
        lock.release()
    out(_table_footer(returns))
    out(
        f"wrote {out_dir / 'results.json'}"
        + (f" and {len(videos)} video(s)" if videos else "")
        + f" in {wall_seconds:.1f} s"
    )
    return Evaluation(out_dir, results, videos)


def _both(*hooks: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
    def call(episode: int, env: Any) -> None:
        for hook in hooks:
            hook(episode, env)

    return call


def _claim_out_dir(options: EvalOptions, checkpoint_file: Path, out: Callable[[str], None]) -> rundir.RunDirLock:
    """The output folder, created and locked (one evaluation writes a folder; the lock is held
    until the caller releases it). A named ``out_dir`` is checked again under the lock: another
    evaluation may have filled it since. A run being trained is said: its evaluation folder is
    written beside the training, which never touches it."""
    if options.out_dir is None:
        trainer = rundir.holder(run_dir_of(checkpoint_file))
        if trainer is not None:
            out(
                f"note: {run_dir_of(checkpoint_file)} is being trained ({trainer}): evaluating {checkpoint_file.name} "
                "as saved now, into its eval/ folder, which training does not write"
            )
        return rundir.RunDirLock(default_out_dir(checkpoint_file), key="out_dir").acquire()
    out_dir = cli.check_out_dir(options.out_dir, options.overwrite)
    lock = rundir.RunDirLock(out_dir, key="out_dir").acquire()
    try:
        cli.check_out_dir(out_dir, options.overwrite)
    except BaseException:
        lock.release()
        raise
    return lock


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _table_footer(returns: list[float]) -> str:
    mean, std = float(np.mean(returns)), float(np.std(returns))
    return (
        f"{'mean':>8}  {mean:>9.2f}  ± {std:.2f} (std over {len(returns)} episodes; "
        f"min {min(returns):.2f}, max {max(returns):.2f})"
    )


def _results(
    options: EvalOptions,
    checkpoint_file: Path,
    config: dict[str, Any],
    module: Any,
    counters: dict[str, int | None],
    seed: int,
    returns: list[float],
    lengths: list[int],
    videos: list[Path],
    out_dir: Path,
    wall_seconds: float,
    action_repeat: int,
    device: Any,
) -> dict[str, Any]:
    from pixelsac.checkpoint import FORMAT_VERSION
    from pixelsac.precision import SIX

    # the switches pixelsac adds
    beyond_six = (
        "unbiased_moments",
        "stochastic_weights",
        "stochastic_first_moment",
        "derived_target",
        "adaptive_target_scale",
        "headroom_growth",
        "fp32_q_output",
        "fp32_actor_loss",
        "fp32_actor_features",
    )

    policy = module.precision_policy
    return {
        "task": config["task"],
        "checkpoint": str(checkpoint_file),
        "env_frames": counters["env_frames"],
        "updates": counters["updates"],
        "precision": config.get("precision"),
        "arithmetic": options.arithmetic,  # trained: as trained; fp32 / fp64: the weights widened to act
        "lowp": {name: bool(getattr(policy, name)) for name in (*SIX, *beyond_six)},
        "training_seed": config.get("seed"),
        "seed": seed,
        "sample": options.sample,
        "device": str(device),
        "episodes": len(returns),
        "returns": returns,
        "lengths": lengths,  # agent steps; env frames = length x action_repeat
        "action_repeat": action_repeat,
        "mean": float(np.mean(returns)),
        "std": float(np.std(returns)),  # population std, as the training log's eval/return_std
        "min": float(min(returns)),
        "max": float(max(returns)),
        "all_finite": all(math.isfinite(r) for r in returns),
        "wall_seconds": wall_seconds,
        "videos": [str(path.relative_to(out_dir)) for path in videos],
        "checkpoint_format": FORMAT_VERSION,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: 0 on success, 2 with one ``error: ...`` line on bad input."""

    def body(args: list[str]) -> int:
        evaluate(parse_options(args))
        return 0

    return cli.run_command(body, argv, USAGE)


if __name__ == "__main__":
    from pixelsac import allocator

    allocator.configure()  # glibc malloc keeps large freed buffers, as under make (pixelsac/allocator.py)
    sys.exit(main())
