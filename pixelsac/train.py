"""Train pixel SAC (DrQ) on DeepMind Control::

    python -m pixelsac.train task=cheetah_run
    python -m pixelsac.train preset=tiny precision=fp32 seed=3
    python -m pixelsac.train task=walker_walk agent.batch_size=256 trainer.devices=2
    python -m pixelsac.train resume=runs/cheetah_run/RUN train.env_frames=1000000
    python -m pixelsac.train task=walker_walk run_dir=runs/walker_s1 resume=auto   # a job that may be requeued

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

import contextlib
import csv
import datetime
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pixelsac.config import ConfigError, load_config, to_plain

USAGE = __doc__
EXIT_BAD_INPUT = 2
EXIT_NUMERICAL_FAILURE = 3
#: A run stopped by a signal, its work saved (or nothing new to save): EX_TEMPFAIL, "try again
#: later" -- run the same command with resume=auto (or resume=RUN_DIR) to continue.
EXIT_STOPPED = 75


class UsageError(ValueError):
    """A problem with what the user asked for (exit code 2)."""


@dataclass
class Run:
    """Everything a training run is made of, built and checked before anything is written."""

    cfg: Any
    run_dir: Path
    env: Any
    eval_env: Any
    replay: Any
    module: Any
    collector: Any
    stream: Any
    trainer: Any
    resume_from: Path | None = None  # the checkpoint a resumed run continues from
    stopper: Any = None  # the StopOnSignal callback, when stop signals are handled
    exit_code: int = 0  # what the command exits with: 0 done, EXIT_STOPPED, EXIT_NUMERICAL_FAILURE


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's start-up chatter (tips, device lines, an experiment dir that holds our config,
    a single-process data loader) says nothing a pixelsac user can act on; our own lines say
    which device and precision run. Warnings that matter still show."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        for pattern in ("does not have many workers", "IterableDataset", "exists and is not empty",
                        "LeafSpec", "Total length of `DataLoader`", "resuming from a checkpoint that ended",
                        "dataloader_iter"):
            warnings.filterwarnings("ignore", message=f".*{pattern}.*")
        yield


def default_run_dir(cfg: Any) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / cfg.task / f"{stamp}_{cfg.precision}_s{cfg.seed}"


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
    from pixelsac.config import parse_overrides
    from pixelsac.envs import available_tasks

    given = parse_overrides(argv)
    resume, run_dir = given.get("resume"), given.get("run_dir")
    if resume == "auto":
        if not run_dir:
            raise ConfigError("resume=auto needs run_dir=DIR: the directory the job writes to and, when it already "
                              "holds a checkpoint, resumes from")
        file = ckpt.in_run_dir(Path(str(run_dir)))
        if file is None:
            return load_config(argv, valid_tasks=available_tasks()), None
    elif resume is None:
        return load_config(argv, valid_tasks=available_tasks()), None
    else:
        file = ckpt.resolve(str(resume), prefer="last")
    stored = ckpt.load(file, trust=bool(given.get("trust_checkpoint", False)))
    base = dict(stored["hyper_parameters"]["config"])
    base["run_dir"] = str(run_dir) if resume == "auto" else \
        str(file.parent.parent if file.parent.name == "checkpoints" else file.parent)
    cfg = load_config(argv, valid_tasks=available_tasks(), base=base)
    return cfg, ckpt.resume_point(file, stored)


SPAWNING_STRATEGIES = ("ddp_spawn", "ddp_fork", "ddp_notebook")


def make_trainer(cfg: Any) -> Any:
    """The Lightning Trainer from ``cfg.trainer`` (callbacks and loggers are attached later).

    ``strategy=ddp`` becomes DDP with ``find_unused_parameters``: SAC backpropagates three losses
    per step, each through a different part of the module.
    """
    import lightning as L

    args = dict(cfg.trainer)
    strategy = args.get("strategy", "auto")
    if isinstance(strategy, str) and strategy in SPAWNING_STRATEGIES:
        raise UsageError(f"trainer.strategy={strategy} is not supported: it pickles the run into new processes "
                         "(environments and GL contexts do not pickle); use trainer.strategy=ddp")
    several = args.get("devices", 1) not in (1, "1", [0]) or args.get("num_nodes", 1) > 1
    if strategy == "ddp" or (strategy == "auto" and several):  # "auto" would pick plain DDP
        args["strategy"] = "ddp_find_unused_parameters_true"
    try:
        with _quiet_lightning():
            return L.Trainer(**args, max_epochs=-1, precision="32-true", logger=False, callbacks=[],
                             enable_checkpointing=False, default_root_dir=cfg.run_dir or None)
    except Exception as exc:  # Lightning's own validation of accelerator/devices/strategy...
        raise UsageError(f"invalid trainer settings: {str(exc).splitlines()[0]}") from exc


def shared_run_dir(cfg: Any, rank: int) -> Path:
    """The run directory, the same on every rank: Lightning's DDP launcher re-runs this command
    for ranks > 0, which find the directory rank 0 chose in the environment it passes on."""
    if cfg.run_dir:
        return Path(cfg.run_dir)
    if rank > 0 and os.environ.get("PIXELSAC_RUN_DIR"):
        return Path(os.environ["PIXELSAC_RUN_DIR"])
    run_dir = default_run_dir(cfg)
    os.environ["PIXELSAC_RUN_DIR"] = str(run_dir)
    return run_dir


def replay_placement(cfg: Any, training_device: Any) -> tuple[Any, bool]:
    """``(device, pin_memory)`` for the replay rings from ``replay.device``, ``replay.pin_memory``
    and the device this rank trains on (``trainer.strategy.root_device``).

    ``auto`` is the training device, or host memory (None) when that is a CPU: there numpy
    storage is the training device's memory already. A bare ``cuda`` is this rank's GPU.
    ``pin_memory`` null is on exactly when batches go from host replay to a CUDA device. A device
    or pinned memory this machine lacks is a ConfigError (one line, exit code 2).
    """
    import torch

    setting, pin = cfg.replay.device, cfg.replay.pin_memory
    device = None
    if setting == "auto":
        device = None if training_device.type == "cpu" else training_device
    elif setting is not None:
        device = torch.device(setting)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"replay.device={setting} needs a CUDA GPU and torch sees none; "
                                  "use replay.device=null (host memory) or auto")
            if device.index is None and training_device.type == "cuda":
                device = training_device  # under DDP each rank keeps its replay on its own GPU
            elif device.index is not None and device.index >= torch.cuda.device_count():
                raise ConfigError(f"replay.device={setting}, but torch sees {torch.cuda.device_count()} CUDA "
                                  f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    if pin is None:
        pin = device is None and training_device.type == "cuda"
    elif pin and device is not None:
        raise ConfigError(f"replay.pin_memory=true applies to host replay; replay.device={setting} already "
                          "samples batches on the device (leave pin_memory null)")
    elif pin and not torch.cuda.is_available():
        raise ConfigError("replay.pin_memory=true needs CUDA (page-locked memory serves host->GPU copies) "
                          "and torch sees no CUDA device; use replay.pin_memory=null")
    return device, bool(pin)


def build_run(cfg: Any, resume_from: Path | None = None, *, stop: Any = None,
              resume_world: int | None = None) -> Run:
    """Build envs, replay, module, collector and Trainer for ``cfg``; writes nothing.

    With several processes (``trainer.devices``/``num_nodes``), each rank owns its environments,
    replay buffer and seed stream (seeds offset by 1000 per rank); the weights start identical.
    ``stop`` (a :class:`pixelsac.stopping.StopRequest`) adds the stop-on-signal callback;
    ``resume_world`` is the number of ranks that wrote the checkpoint resumed from.
    """
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import TQDMProgressBar
    from torch.utils.data import DataLoader

    from pixelsac.callbacks import Checkpointer, Evaluator, ProgressBar, StopWhenCollected, TrainingLogger
    from pixelsac.collect import Collector, ExperienceStream
    from pixelsac.envs import DMCEnv
    from pixelsac.envs.vector import make_envs
    from pixelsac.module import SACModule
    from pixelsac.perf import PerfTracker
    from pixelsac.replay import ReplaySet
    from pixelsac.stopping import StopOnSignal

    trainer = make_trainer(cfg)
    rank, world = trainer.global_rank, trainer.world_size
    if resume_world is not None and resume_world != world:
        raise UsageError(f"{resume_from} was written by {resume_world} data-parallel rank(s), each with its own replay "
                         f"and RNG states; this run has {world}: set trainer.devices and trainer.num_nodes to match")
    replay_device, pin_memory = replay_placement(cfg, trainer.strategy.root_device)  # fails before any env starts
    if cfg.perf.cuda_graphs:
        from pixelsac.graphs import graph_conflicts

        conflict = graph_conflicts(cfg, trainer.strategy.root_device.type, world)
        if conflict:
            raise ConfigError(conflict)
    run_dir = shared_run_dir(cfg, rank)
    if rank == 0 and resume_from is None and run_dir.exists() \
            and (not run_dir.is_dir() or any(run_dir.iterdir())) and not cfg.overwrite:
        if cfg.resume != "auto":
            raise UsageError(f"run directory {run_dir} already exists and is not empty; "
                             "choose another run_dir=..., pass overwrite=true, or resume=" + str(run_dir))
        if not (run_dir / "config.yaml").is_file():  # a previous attempt that saved no checkpoint is fine
            raise UsageError(f"run directory {run_dir} is not empty and holds no pixelsac run (no config.yaml, no "
                             "checkpoint); resume=auto starts only in an empty directory or an earlier attempt's: "
                             "choose another run_dir=... or pass overwrite=true")
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    L.seed_everything(cfg.seed, verbose=False)

    env_kwargs = dict(obs=cfg.env.obs, image_size=cfg.env.image_size, frame_stack=cfg.env.frame_stack,
                      action_repeat=cfg.env.action_repeat, camera_id=cfg.env.camera_id,
                      episode_frames=cfg.env.episode_frames)
    eval_env = DMCEnv(cfg.task, seed=cfg.seed + 100_000, **env_kwargs)
    eval_env.render(16)  # a missing GL library fails here, before anything is written (no RNG drawn)
    seed_frames = cfg.train.seed_steps * eval_env.action_repeat
    if resume_from is None and cfg.train.updates_per_step > 0 and cfg.train.env_frames <= seed_frames:
        eval_env.close()
        raise ConfigError(f"train.env_frames={cfg.train.env_frames} ends within the random seed phase "
                          f"(train.seed_steps={cfg.train.seed_steps} x action repeat {eval_env.action_repeat} "
                          f"= {seed_frames} frames), so no update would run; raise train.env_frames or lower "
                          "train.seed_steps")
    rank_seed = cfg.seed + 1000 * rank
    seeds = [rank_seed + i for i in range(cfg.env.num_envs)]
    env = make_envs(cfg.task, seeds, parallel=cfg.env.num_envs > 1, **env_kwargs)

    replay = ReplaySet(cfg.env.num_envs, cfg.replay.capacity, env.frame_shape, env.frame_dtype,
                       env.frame_stack, env.action_dim, device=replay_device, pin_memory=pin_memory)
    module = SACModule(to_plain(cfg), env.obs_shape, env.action_dim)
    if rank > 0:  # identical initial weights everywhere; each rank augments and samples its own way
        torch.manual_seed(rank_seed)
    rng = np.random.default_rng(rank_seed)
    seed_steps = -(-cfg.train.seed_steps // world)  # like the budget, seed steps count over all ranks
    collector = Collector(env, replay, module.act, seed_steps, rng, world_size=world)
    total_agent_steps = -(-cfg.train.env_frames // (env.action_repeat * world))  # the budget is over all ranks
    stream = ExperienceStream(collector, cfg.agent.batch_size, total_agent_steps, cfg.train.updates_per_step, rng)

    episode_steps = -(-cfg.env.episode_frames // env.action_repeat) * cfg.env.num_envs
    checkpointer = Checkpointer(run_dir, collector, cfg.checkpoint.save_replay, max_wait_steps=episode_steps, stop=stop)
    callbacks = [TrainingLogger(collector),
                 Evaluator(eval_env, collector, checkpointer, cfg.train.eval_every_frames, cfg.train.eval_episodes,
                           video_dir=run_dir / "videos", video_every_evals=cfg.train.video_every_evals,
                           video_size=min(cfg.train.video_size, 480), stop=stop),
                 checkpointer, StopWhenCollected(stream)]
    stopper = None
    if stop is not None:
        stopper = StopOnSignal(stop, stream, collector, checkpointer, cfg.stop.max_wait_steps, cfg.stop.max_wait_seconds)
        callbacks.append(stopper)
    # our bar (frames first) replaces Lightning's default one
    bars = [i for i, c in enumerate(trainer.callbacks) if isinstance(c, TQDMProgressBar)]
    for i in bars:
        trainer.callbacks[i] = ProgressBar(collector)
    trainer.callbacks.extend(callbacks)
    if cfg.perf.track:  # first: its update clock must stop before any other callback's batch-end work
        trainer.callbacks.insert(0, PerfTracker(collector, run_dir, cfg))
    # its own generator: creating the loader's iterator must not draw from the global torch RNG,
    # or a resumed run would diverge from the uninterrupted one
    stream_loader = DataLoader(stream, batch_size=None, num_workers=0, generator=torch.Generator())
    return Run(cfg, run_dir, env, eval_env, replay, module, collector, stream_loader, trainer, resume_from, stopper)


def attach_loggers(run: Run, resume_frames: int | None) -> None:
    """CSV (``metrics.csv``) and TensorBoard (``tb/``) loggers in the run directory. On resume
    the CSV keeps its rows up to the checkpoint's frame (later ones were never checkpointed)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    metrics = run.run_dir / "metrics.csv"
    kept_rows, header = [], []
    if resume_frames is not None and metrics.is_file():
        with open(metrics, newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            kept_rows = [row for row in reader if row.get("step") and float(row["step"]) <= resume_frames]
    csv_logger = CSVLogger(run.run_dir, name="", version="")
    writer = csv_logger.experiment  # deletes an existing metrics.csv: the kept rows go back below
    if header:
        with open(metrics, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=header)
            out.writeheader()
            out.writerows(kept_rows)
        writer.metrics_keys = sorted(header)
    loggers = [csv_logger, TensorBoardLogger(run.run_dir, name="tb", version="")]
    run.trainer.loggers = loggers  # the Trainer was built without them so that nothing was written early


def write_run_dir(run: Run) -> None:
    from omegaconf import OmegaConf

    run.run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(run.cfg, run.run_dir / "config.yaml", resolve=True)


def train(cfg: Any, resume_from: Path | None = None, resume_frames: int | None = None, *,
          stop: Any = None, resume: Any = None) -> Run:
    """Build, announce and fit a run (continuing from ``resume_from`` -- or ``resume``, a
    :class:`pixelsac.checkpoint.ResumePoint` -- when given). With ``stop`` (a
    :class:`pixelsac.stopping.StopRequest` whose handlers are installed), a stop signal ends the
    run early with its work saved; ``run.exit_code`` says how it ended."""
    from pixelsac.precision import NumericalFailure

    if resume is not None:
        resume_from, resume_frames = resume.checkpoint, resume.env_frames
    run = build_run(cfg, resume_from, stop=stop, resume_world=resume.world_size if resume else None)
    zero = run.trainer.global_rank == 0
    if zero:
        write_run_dir(run)
    with _quiet_lightning():
        attach_loggers(run, resume_frames if zero else None)
    policy = run.module.precision_policy
    say = print if zero else (lambda *args, **kwargs: None)  # one voice under data parallelism
    say(f"run directory: {run.run_dir}")
    if resume is not None:
        say(resume.describe())
    elif resume_from is not None:
        say(f"resuming from {resume_from} at env frame {resume_frames}")
    device = run.trainer.strategy.root_device
    say(f"task {cfg.task} from {cfg.env.obs}, action repeat {run.env.action_repeat}; "
        f"{run.trainer.world_size} x {device.type}; {policy.describe()}")
    say(run.replay.describe() + (f" per rank, {run.trainer.world_size} ranks" if run.trainer.world_size > 1 else ""))
    if policy.is_pure_low and device.type == "cpu":
        say(f"warning: {cfg.precision} on a CPU is emulated and several times slower than fp32; "
              "use a GPU for real runs (precision=fp32 for a fast CPU run)")
    try:
        with _quiet_lightning():
            run.trainer.fit(run.module, train_dataloaders=run.stream,
                            ckpt_path=str(resume_from) if resume_from else None,
                            weights_only=not cfg.trust_checkpoint)
    except NumericalFailure as failure:
        (run.run_dir / "failure.json").write_text(json.dumps(
            {"message": str(failure), "env_frames": failure.env_frames, "updates": run.module.updates,
             "loss_scales": run.module.loss_scales(), "skipped": run.module.skipped,
             "checkpoint": failure.checkpoint}, indent=2))
        raise
    finally:
        run.env.close()  # frees the physics and its GL contexts (a long process may train many runs)
        run.eval_env.close()
    evaluator = next(c for c in run.trainer.callbacks if type(c).__name__ == "Evaluator")
    outcome = run.stopper.outcome if run.stopper is not None else None
    if outcome is not None:
        say(outcome.message(run.run_dir))
        run.exit_code = EXIT_NUMERICAL_FAILURE if outcome.reason == "non-finite weights" else EXIT_STOPPED
    else:
        say(f"done: {run.collector.total_env_frames} env frames, {run.module.updates} updates, "
              f"best eval return {evaluator.best_return:.1f}; checkpoints in {run.run_dir / 'checkpoints'}")
    return run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE)
        return 0
    from pixelsac.checkpoint import CheckpointError
    from pixelsac.envs import EnvError
    from pixelsac.envs.vector import EnvWorkerError
    from pixelsac.precision import NumericalFailure
    from pixelsac.stopping import handle_stop_signals

    try:
        cfg, point = resolve_run(argv)
        if point is not None and point.finished(cfg.train.env_frames):
            print(f"already done: {point.checkpoint} holds {point.env_frames} env frames (train.env_frames="
                  f"{cfg.train.env_frames}) and their final evaluation; raise train.env_frames to train further")
            return 0
        with handle_stop_signals(cfg.stop.signals) as stop:
            return train(cfg, stop=stop, resume=point).exit_code
    except (ConfigError, EnvError, UsageError, CheckpointError, EnvWorkerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NumericalFailure as failure:
        print(f"error: training stopped: {failure}", file=sys.stderr)
        return EXIT_NUMERICAL_FAILURE


if __name__ == "__main__":
    sys.exit(main())
