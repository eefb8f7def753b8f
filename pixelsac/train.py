"""Train pixel SAC (DrQ) on DeepMind Control::

    pixelsac-train task=cheetah_run
    pixelsac-train preset=tiny precision=fp32 seed=3
    pixelsac-train task=walker_walk agent.batch_size=256 trainer.devices=2
    pixelsac-train resume=runs/cheetah_run/RUN train.env_frames=1000000
    pixelsac-train task=walker_walk run_dir=runs/walker_s1 resume=auto   # a job that may be requeued

Arguments are ``key=value`` overrides of ``conf/config.yaml`` (see the README). A mistake in
them, an unknown task, a missing OpenGL library or an unusable checkpoint is reported in one
line with exit code 2, before anything is written. A run stopped by a numerical failure (non-
finite weights, a collapsed loss scale) exits with code 3 after saying why.

SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (``stop.signals``) stop a run after its current update:
it saves ``last.ckpt`` and its replay file -- at the episode boundary when that is near, for
an exact resume -- prints one line saying what it saved, and exits with code 75; a second
signal saves at once, a signal during that save exits at once with 128 + the signal number
(the previous checkpoint stays). ``resume=auto`` continues from ``run_dir`` when it holds a
checkpoint and starts there otherwise; a run whose budget is already reached exits 0 at once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pixelsac import cli, train_args
from pixelsac.config import ConfigError, load_config, parse_overrides

USAGE = __doc__


def resolve_config(argv: list[str]) -> tuple[Any, Path | None, int | None]:
    """The run's configuration and, for ``resume=...``, the checkpoint it continues from and the
    env frame (over all ranks) it was taken at. See :func:`resolve_run`."""
    cfg, point = resolve_run(argv)
    return cfg, (point.checkpoint if point else None), (point.env_frames if point else None)


def resolve_run(argv: list[str]) -> tuple[Any, Any]:
    """The run's configuration and, for ``resume=...``, where it continues from.

    A resumed run takes the checkpoint's configuration (overridable in budgets, logging,
    hardware, stop and safety keys; other keys may only repeat their stored values) and writes
    into the checkpoint's run directory. ``resume=auto`` resumes from ``run_dir``'s checkpoint
    when there is one and is a fresh run otherwise -- the same command for a job's first start
    and every requeue. The second value is a :class:`pixelsac.checkpoint.ResumePoint` or None.
    """
    from pixelsac import checkpoint as ckpt
    from pixelsac.envs import available_tasks

    given = parse_overrides(argv)
    resume, run_dir = given.get("resume"), given.get("run_dir")
    if resume == "auto":
        if not run_dir:
            raise ConfigError(
                "resume=auto needs run_dir=DIR: the directory the job writes to and, when it already "
                "holds a checkpoint, resumes from"
            )
        file = ckpt.in_run_dir(Path(str(run_dir)))
        if file is None:
            return load_config(argv, valid_tasks=available_tasks()), None
    elif resume is None:
        return load_config(argv, valid_tasks=available_tasks()), None
    else:
        file = ckpt.resolve(str(resume), prefer="last")
    stored = ckpt.load(file, trust=bool(given.get("trust_checkpoint", False)))
    base = dict(stored["hyper_parameters"]["config"])
    base["run_dir"] = (
        str(run_dir)
        if resume == "auto"
        else str(file.parent.parent if file.parent.name == "checkpoints" else file.parent)
    )
    cfg = load_config(argv, valid_tasks=available_tasks(), base=base)
    return cfg, ckpt.resume_point(file, stored)


def train(
    cfg: Any, resume_from: Path | None = None, resume_frames: int | None = None, *, stop: Any = None, resume: Any = None
) -> Any:
    """Build, announce and fit a run (continuing from ``resume_from`` -- or ``resume``, a
    :class:`pixelsac.checkpoint.ResumePoint` -- when given). With ``stop`` (a
    :class:`pixelsac.stopping.StopRequest` whose handlers are installed), a stop signal ends the
    run early with its work saved. Returns the :class:`pixelsac.run.Run`; ``run.exit_code`` says
    how it ended."""
    from pixelsac import run as runs
    from pixelsac.precision import NumericalFailure

    if resume is not None:
        resume_from, resume_frames = resume.checkpoint, resume.env_frames
    run = runs.build_run(cfg, resume_from, stop=stop, resume_world=resume.world_size if resume else None)
    zero = run.trainer.global_rank == 0
    if zero:
        runs.write_run_dir(run)
    with cli.quiet_lightning():
        pending = resume.pending_eval_frames if resume is not None else None
        runs.attach_loggers(run, resume_frames if zero else None, pending)
    policy = run.module.precision_policy
    say = print if zero else (lambda *args, **kwargs: None)  # one voice under data parallelism
    say(f"run directory: {run.run_dir}")
    if resume is not None:
        say(resume.describe())
    elif resume_from is not None:
        say(f"resuming from {resume_from} at env frame {resume_frames}")
    device = run.trainer.strategy.root_device
    say(
        f"task {cfg.task} from {cfg.env.obs}, action repeat {run.env.action_repeat}; "
        f"{run.trainer.world_size} x {device.type}; {policy.describe()}"
    )
    say(run.replay.describe() + (f" per rank, {run.trainer.world_size} ranks" if run.trainer.world_size > 1 else ""))
    if policy.is_pure_low and device.type == "cpu":
        say(
            f"warning: {cfg.precision} on a CPU is emulated and several times slower than fp32; "
            "use a GPU for real runs (precision=fp32 for a fast CPU run)"
        )
    try:
        with cli.quiet_lightning():
            run.trainer.fit(
                run.module,
                train_dataloaders=run.stream,
                ckpt_path=str(resume_from) if resume_from else None,
                weights_only=not cfg.trust_checkpoint,
            )
    except NumericalFailure as failure:
        (run.run_dir / "failure.json").write_text(
            json.dumps(
                {
                    "message": str(failure),
                    "env_frames": failure.env_frames,
                    "updates": run.module.updates,
                    "loss_scales": run.module.loss_scales(),
                    "skipped": run.module.skipped,
                    "checkpoint": failure.checkpoint,
                },
                indent=2,
            )
        )
        raise
    finally:
        run.env.close()  # frees the physics and its GL contexts (a long process may train many runs)
        run.eval_env.close()
        if run.eval_worker is not None:
            run.eval_worker.close()
    evaluator = next(c for c in run.trainer.callbacks if type(c).__name__ == "Evaluator")
    outcome = run.stopper.outcome if run.stopper is not None else None
    if outcome is not None:
        say(outcome.message(run.run_dir))
        run.exit_code = cli.EXIT_NUMERICAL_FAILURE if outcome.reason == "non-finite weights" else cli.EXIT_STOPPED
    else:
        say(
            f"done: {run.collector.total_env_frames} env frames, {run.module.updates} updates, "
            f"best eval return {evaluator.best_return:.1f}; checkpoints in {run.run_dir / 'checkpoints'}"
        )
    return run


def _command(argv: list[str]) -> int:
    argv, dry_run = train_args.split_print_config(argv)
    train_args.check_early(argv)  # a mistyped key answers before dm_control and torch load
    cfg, point = resolve_run(argv)
    if dry_run:
        print(train_args.render(cfg), end="")
        return 0
    if point is not None and point.finished(cfg.train.env_frames):
        print(
            f"already done: {point.checkpoint} holds {point.env_frames} env frames (train.env_frames="
            f"{cfg.train.env_frames}) and their final evaluation; raise train.env_frames to train further"
        )
        return 0
    # Imported after the configuration is checked: it loads Lightning, and a mistyped key should
    # not wait for that before it is reported.
    from pixelsac.stopping import handle_stop_signals

    with handle_stop_signals(cfg.stop.signals) as stop:
        return train(cfg, stop=stop, resume=point).exit_code


def main(argv: list[str] | None = None) -> int:
    return cli.run_command(_command, argv, train_args.usage(USAGE))


if __name__ == "__main__":
    from pixelsac import allocator

    allocator.configure()  # glibc malloc keeps large freed buffers, as under make (pixelsac/allocator.py)
    sys.exit(main())
