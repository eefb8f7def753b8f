"""Train pixel SAC (DrQ) on DeepMind Control::

    pixelsac-train task=cheetah_run
    pixelsac-train preset=tiny precision=fp32 seed=3
    pixelsac-train task=walker_walk agent.batch_size=256 trainer.devices=2
    pixelsac-train resume=runs/cheetah_run/RUN train.env_frames=1000000
    pixelsac-train task=walker_walk run_dir=runs/walker_s1 resume=auto   # a job that may be requeued

Arguments are ``key=value`` overrides of ``conf/config.yaml`` (see the README). A mistake in
them (a value out of range, NaN, a replay larger than memory), an unknown task, a missing
OpenGL library, an unusable checkpoint (``best.ckpt``, an empty or zeroed file, a replay file
that is missing, corrupt, pickled, or another run's or step's), or a run directory that another
process holds, that cannot be made or written, or where a name the run writes is a link, is
reported in one line with exit code 2, before anything is written. A Ctrl-C before the run's own
signal handling begins (libraries loading) is one line and exit code 130. A run stopped by a
numerical failure (non-finite weights, a collapsed loss scale, every update skipped) exits with
code 3 after saying why; a write that fails while running (disk full) with code 74, in one line
naming the file, leaving no partial file. The exit codes are listed in
``pixelsac.cli.EXIT_CODES``.

One process writes a run directory: it holds ``RUN_DIR/.lock`` (``fcntl.flock``, released by
the kernel however the process ends). ``trust_checkpoint=true`` holds for the one checkpoint
this command loads; it is never stored, and a stored one is ignored with a warning.

SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (``stop.signals``) stop a run after its current update:
it saves ``last.ckpt`` and its replay file -- at the episode boundary when that is near, for
an exact resume -- prints one line saying what it saved, and exits with code 75; a second
signal saves at once, a signal during that save exits at once with 128 + the signal number
(the previous checkpoint stays). ``resume=auto`` continues from ``run_dir`` when it holds a
checkpoint and starts there otherwise; a run whose budget is already reached exits 0 at once.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

from pixelsac import cli, files, rundir
from pixelsac.config import INVOCATION_ONLY_KEYS, ConfigError, load_config, parse_overrides

USAGE = __doc__
#: What the one line of a failed write says after naming it.
AFTER_A_FAILED_WRITE = (
    "the last complete checkpoint stands and no partial file is left: free the space or fix the filesystem, "
    "then run the same command with resume=auto to continue"
)


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
    and every requeue. The second value is a :class:`pixelsac.checkpoint.ResumePoint` or None;
    it carries the checkpoint as loaded here, the only time it is read (trusted only when this
    command line says ``trust_checkpoint=true``).
    """
    from pixelsac import checkpoint as ckpt
    from pixelsac.envs import available_tasks
    from pixelsac.envs.dmc import listed_cuda_index, select_egl_device

    given = parse_overrides(argv)
    if str(given.get("trainer.accelerator", "auto")).lower() != "cpu":
        # validating the task imports dm_control, which opens its EGL display: on the GPU of a listed
        # device (trainer.devices=[2,3]) when the command line names one, else as egl_device_for_process says
        select_egl_device(listed_cuda_index(given.get("trainer.devices"), os.environ))
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
    if file.name == "best.ckpt":  # refused before it is even read
        ckpt.check_resumable(file, {})
    stored = ckpt.load(file, trust=given.get("trust_checkpoint") is True)
    replays = ckpt.check_resumable(file, stored)
    if replays and ckpt.run_id_of(stored) is None:
        print(
            f"warning: {file} was written before checkpoints named their run, so its replay file cannot be checked "
            "to be this run's; it is taken as it is (checkpoints written from now on name it)",
            file=sys.stderr,
        )
    base = stored_base_config(file, stored)
    base["run_dir"] = (
        str(run_dir)
        if resume == "auto"
        else str(file.parent.parent if file.parent.name == "checkpoints" else file.parent)
    )
    cfg = load_config(argv, valid_tasks=available_tasks(), base=base)
    return cfg, ckpt.resume_point(file, stored, replays)


def stored_base_config(file: Path, stored: dict[str, Any]) -> dict[str, Any]:
    """The configuration a checkpoint stores, less what holds for one invocation only: a stored
    ``trust_checkpoint`` (written by versions before this rule) is dropped with a warning."""
    base = dict(stored["hyper_parameters"]["config"])
    for key in INVOCATION_ONLY_KEYS:
        if base.pop(key, None):
            print(
                f"warning: {file} stores {key}=true; ignored: trust is given on the command line only, "
                "for the one checkpoint that command loads",
                file=sys.stderr,
            )
    return base


def train(
    cfg: Any, resume_from: Path | None = None, resume_frames: int | None = None, *, stop: Any = None, resume: Any = None
) -> Any:
    """Build, announce and fit a run (continuing from ``resume_from`` -- or ``resume``, a
    :class:`pixelsac.checkpoint.ResumePoint` -- when given). With ``stop`` (a
    :class:`pixelsac.stopping.StopRequest` whose handlers are installed), a stop signal ends the
    run early with its work saved. Returns the :class:`pixelsac.run.Run`; ``run.exit_code`` says
    how it ended."""
    from pixelsac import run as runs

    if resume is not None:
        resume_from, resume_frames = resume.checkpoint, resume.env_frames
    run = runs.build_run(
        cfg,
        resume_from,
        stop=stop,
        resume_world=resume.world_size if resume else None,
        loaded=resume.loaded if resume else None,
        replays=resume.replays if resume else None,
    )
    zero = run.trainer.global_rank == 0
    say = print if zero else (lambda *args, **kwargs: None)  # one voice under data parallelism
    lock = None
    try:
        if zero:  # held while this process writes the directory
            lock = runs.claim_run_dir(run, resume)
            runs.write_run_dir(run)
        with cli.quiet_lightning():
            pending = resume.pending_eval_frames if resume is not None else None
            runs.attach_loggers(run, resume_frames if zero else None, pending)
        _fit(run, resume_from, resume_frames, resume, say)
        if stop is not None:
            stop.end()  # before the outcome line: a signal sent on reading it must find the run over
    finally:
        _close(run)
        if lock is not None:
            rundir.remove_partial_files(run.run_dir)
            lock.release()
    run.exit_code = _outcome(run, say)
    return run


def start_lines(run: Any) -> list[str]:
    """What a run says about itself before fitting: task, devices, precision, replay, the
    environment workers (if any) and, on a CPU only, which half-precision kernels run. Described
    by the precision policy resolved for the device the run trains on -- the module's own is the
    CPU's until the Trainer's setup, so a CUDA run would otherwise describe this host's CPU
    kernels."""
    import torch

    from pixelsac.footprint import usable_cores
    from pixelsac.precision import PrecisionPolicy

    cfg, device, world = run.cfg, run.trainer.strategy.root_device, run.trainer.world_size
    policy = PrecisionPolicy.from_config(cfg, device.type)
    lines = [
        f"task {cfg.task} from {cfg.env.obs}, action repeat {run.env.action_repeat}; "
        f"{world} x {device.type}; {policy.describe()}",
        run.replay.describe() + (f" per rank, {world} ranks" if world > 1 else ""),
    ]
    num_envs, overlap = cfg.env.num_envs, bool(cfg.train.overlap_collection)
    if num_envs > 1 or overlap:
        how = "stepping while the learner updates (train.overlap_collection)" if overlap else "stepped between updates"
        lines.append(f"collection: {num_envs} environment{'s' * (num_envs > 1)} in worker processes, {how}")
        threads, cores = torch.get_num_threads(), usable_cores()
        if overlap and device.type == "cpu" and threads + num_envs > cores:
            fix = f"train.num_threads={cores - num_envs} leaves the workers cores of their own"
            lines.append(
                f"  note: the update's {threads} threads and {num_envs} worker{'s' * (num_envs > 1)} share {cores} "
                f"cores and take turns rather than overlap" + (f" ({fix})" if cores > num_envs else "")
            )
    kernels = policy.cpu_kernels()  # None off the CPU
    if kernels is not None:
        lines.append(kernels)
    return lines


def _fit(run: Any, resume_from: Path | None, resume_frames: int | None, resume: Any, say: Any) -> None:
    """Announce the run and fit it; a numerical failure leaves ``failure.json`` behind."""
    from pixelsac.precision import NumericalFailure
    from pixelsac.provenance import code_version, describe

    say(f"run directory: {run.run_dir}")
    say(f"code: {describe(code_version())}")
    if resume is not None:
        say(resume.describe())
    elif resume_from is not None:
        say(f"resuming from {resume_from} at env frame {resume_frames}")
    for line in start_lines(run):
        say(line)
    try:
        with cli.quiet_lightning():
            # the checkpoint was loaded (and trusted or not) once, in resolve_run: the Trainer's
            # RunDirCheckpointIO hands that dict over, and reads nothing else but weights-only
            run.trainer.fit(
                run.module,
                train_dataloaders=run.stream,
                ckpt_path=str(resume_from) if resume_from else None,
                weights_only=True,
            )
    except NumericalFailure as failure:
        files.write_atomically(
            run.run_dir / "failure.json",
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
            ),
        )
        raise


def _close(run: Any) -> None:
    """Free the physics and GL contexts (a long process may train many runs) and the eval worker."""
    for closing in (run.env.close, run.eval_env.close, getattr(run.eval_worker, "close", None)):
        if closing is not None:
            try:
                closing()
            except Exception:  # noqa: BLE001 -- closing twice, or after a fault: nothing left to free
                pass


def _outcome(run: Any, say: Any) -> int:
    """Print how the fitted run ended and return its exit code; a run that cannot claim "done"
    (every update skipped, short of its budget) is a :class:`pixelsac.cli.RunFault`."""
    cfg = run.cfg
    evaluator = next(c for c in run.trainer.callbacks if type(c).__name__ == "Evaluator")
    outcome = run.stopper.outcome if run.stopper is not None else None
    if outcome is not None:
        say(outcome.message(run.run_dir))
        return cli.EXIT_NUMERICAL_FAILURE if outcome.reason == "non-finite weights" else cli.EXIT_STOPPED
    updates, skipped = run.module.updates, run.module.skipped.get("critic", 0)
    if updates > 0 and skipped >= updates:
        raise cli.RunFault(
            f"every one of the {updates} critic updates was skipped (loss-scale overflow): the weights never "
            f"trained; loss scales now {run.module.loss_scales()} (lowp.init_scale={cfg.lowp.init_scale}); "
            f"checkpoints in {run.run_dir / 'checkpoints'}",
            cli.EXIT_NUMERICAL_FAILURE,
        )
    frames = run.collector.total_env_frames
    if frames < cfg.train.env_frames:
        raise cli.RunFault(
            f"the run ended at env frame {frames} of train.env_frames={cfg.train.env_frames} without a stop "
            f"signal (a Lightning limit ended fit); its checkpoint is in {run.run_dir / 'checkpoints'}: "
            "resume=auto continues it",
            cli.EXIT_INCOMPLETE,
        )
    say(
        f"done: {frames} env frames, {updates} updates, "
        f"best eval return {evaluator.best_return:.1f}; checkpoints in {run.run_dir / 'checkpoints'}"
    )
    return cli.EXIT_DONE


def _command(argv: list[str], as_program: bool = False) -> int:
    try:
        argv, dry_run = cli.split_print_config(argv)
        cli.check_early(argv)  # a mistyped key answers before dm_control and torch load
        cfg, point = resolve_run(argv)
        if dry_run:
            from pixelsac.run import check_dry_run

            check_dry_run(cfg, fresh=point is None)
            print(cli.config_yaml(cfg), end="")
            return 0
        if point is not None and point.finished(cfg.train.env_frames):
            rundir.tidy(Path(cfg.run_dir))
            print(
                f"already done: {point.checkpoint} holds {point.env_frames} env frames (train.env_frames="
                f"{cfg.train.env_frames}) and their final evaluation; raise train.env_frames to train further"
            )
            return 0
        # Imported after the configuration is checked: it loads Lightning, and a mistyped key should
        # not wait for that before it is reported.
        from pixelsac.stopping import handle_stop_signals
    except KeyboardInterrupt:  # the stop handlers are not installed yet, and nothing was written
        raise cli.Interrupted(cli.INTERRUPTED_WHILE_STARTING) from None

    with handle_stop_signals(cfg.stop.signals, linger=as_program) as stop:
        try:
            stop.exit_code = train(cfg, stop=stop, resume=point).exit_code
        except OSError as exc:  # a write that failed while running: disk full, read-only...
            stop.exit_code = cli.EXIT_IO_FAULT
            where = cfg.run_dir or os.environ.get("PIXELSAC_RUN_DIR", "the run directory")
            raise cli.RunFault(cli.describe_os_error(exc, AFTER_A_FAILED_WRITE, where), cli.EXIT_IO_FAULT) from exc
        except Exception as exc:
            lost = lost_process(exc)
            if lost is None:
                raise
            stop.exit_code = cli.EXIT_PROCESS_LOST
            where = cfg.run_dir or os.environ.get("PIXELSAC_RUN_DIR", "the run directory")
            raise cli.RunFault(
                f"{lost}; the last checkpoint in {where} stands: run the same command with resume=auto to continue",
                cli.EXIT_PROCESS_LOST,
            ) from exc
        return stop.exit_code


def lost_process(exc: BaseException) -> str | None:
    """What to say when ``exc`` means a process the run depends on died -- an environment worker
    (:class:`pixelsac.envs.vector.EnvWorkerError`), another data-parallel rank
    (:func:`pixelsac.distributed.lost_rank`) -- else None. Looked up, not imported: a run that
    never loaded those modules cannot have raised their errors."""
    vector = sys.modules.get("pixelsac.envs.vector")
    if vector is not None and isinstance(exc, vector.EnvWorkerError):
        return str(exc).splitlines()[0]
    distributed = sys.modules.get("pixelsac.distributed")
    return distributed.lost_rank(exc) if distributed is not None else None


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv`` None: this process's arguments, and stop signals that come
    after the run ended are ignored until it exits -- see :mod:`pixelsac.stopping`)."""
    return cli.run_command(functools.partial(_command, as_program=argv is None), argv, lambda: cli.train_usage(USAGE))


if __name__ == "__main__":
    from pixelsac import allocator

    allocator.configure()  # glibc malloc keeps large freed buffers, as under make (pixelsac/allocator.py)
    sys.exit(main())
