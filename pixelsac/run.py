"""A training run assembled: environments, replay, agent, collector, callbacks, Trainer, loggers.

:func:`build_run` builds everything a run is made of from a validated configuration and checks
it (devices, GL, the budget, the run directory) before anything is written; :func:`attach_loggers`
then gives the Trainer its CSV and TensorBoard loggers, keeping on resume the rows up to the
checkpoint. ``python -m pixelsac.train`` (:mod:`pixelsac.train`) fits the result.

Seeds derived from ``seed`` (see :mod:`pixelsac.config`): rank ``r`` of a data-parallel run
collects with ``seed + RANK_SEED_STRIDE * r`` (env ``i`` of a vector: ``+ i``), the evaluation
episodes that choose ``best.ckpt`` use ``seed + EVAL_SEED_OFFSET``.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from pixelsac import cli, files, footprint, logs, rundir
from pixelsac.cli import UsageError
from pixelsac.config import EVAL_SEED_OFFSET, RANK_SEED_STRIDE, ConfigError, stored_config
from pixelsac.distributed import GradientAverage


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
    eval_worker: Any = None  # the EvalWorker process (train.eval_in_worker), closed with the run
    exit_code: int = 0  # what the command exits with: 0 done, EXIT_STOPPED, EXIT_NUMERICAL_FAILURE


def default_run_dir(cfg: Any) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / cfg.task / f"{stamp}_{cfg.precision}_s{cfg.seed}"


SPAWNING_STRATEGIES = ("ddp_spawn", "ddp_fork", "ddp_notebook")


def make_trainer(cfg: Any) -> Any:
    """The Lightning Trainer from ``cfg.trainer`` (callbacks and loggers are attached later).

    ``strategy=ddp`` (or several devices) becomes :class:`pixelsac.distributed.GradientAverage`:
    Lightning's DDP without the wrapper's reducer, since SAC backpropagates three losses per step,
    each through a different part of the module (the reducer needed ``find_unused_parameters``,
    a host read per backward, and re-sent every buffer before every forward).
    """
    args = dict(cfg.trainer)
    strategy = args.get("strategy", "auto")
    if isinstance(strategy, str) and strategy in SPAWNING_STRATEGIES:
        raise UsageError(
            f"trainer.strategy={strategy} is not supported: it pickles the run into new processes "
            "(environments and GL contexts do not pickle); use trainer.strategy=ddp"
        )
    several = args.get("devices", 1) not in (1, "1", [0]) or args.get("num_nodes", 1) > 1
    if strategy == "ddp" or (strategy == "auto" and several):  # "auto" would pick plain DDP
        args["strategy"] = GradientAverage()
    try:
        with cli.quiet_lightning():
            return L.Trainer(
                **args,
                max_epochs=-1,
                precision="32-true",
                logger=False,
                callbacks=[],
                enable_checkpointing=False,
                default_root_dir=cfg.run_dir or None,
            )
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


def check_sizes(cfg: Any, eval_env: Any, replay_device: Any, device: Any, world: int, fresh: bool) -> None:
    """A ConfigError for a budget that ends within the seed phase (``fresh``: a new run), a replay
    too small to sample from, or sizes this machine cannot hold (the replay, the env workers, the
    agent), before any of them is allocated or started. ``eval_env`` gives the shapes, ``device``
    is where the agent trains."""
    from pixelsac.precision import PrecisionPolicy

    seed_frames = cfg.train.seed_steps * eval_env.action_repeat
    if fresh and cfg.train.updates_per_step > 0 and cfg.train.env_frames <= seed_frames:
        raise ConfigError(
            f"train.env_frames={cfg.train.env_frames} ends within the random seed phase "
            f"(train.seed_steps={cfg.train.seed_steps} x action repeat {eval_env.action_repeat} "
            f"= {seed_frames} frames), so no update would run; raise train.env_frames or lower "
            "train.seed_steps"
        )
    footprint.check_replay_fits(cfg, eval_env, replay_device, world)
    value_bytes = PrecisionPolicy(mode=cfg.precision).param_dtype.itemsize
    footprint.check_run_fits(cfg, eval_env, device, world, value_bytes)
    per_env = cfg.replay.capacity // cfg.env.num_envs
    if per_env <= eval_env.frame_stack:  # a sample's stack and its next frame need more slots than that
        raise ConfigError(
            f"replay.capacity={cfg.replay.capacity} leaves each of the {cfg.env.num_envs} env(s) {per_env} slot(s); "
            f"each needs more than its {eval_env.frame_stack} stacked frames: choose replay.capacity >= "
            f"{(eval_env.frame_stack + 1) * cfg.env.num_envs}"
        )


def check_dry_run(cfg: Any, fresh: bool) -> None:
    """What a run checks before it writes anything, without building it (``--print-config``):
    the trainer settings, the replay's placement and the sizes (:func:`check_sizes`)."""
    from pixelsac.replay import replay_placement

    trainer = make_trainer(cfg)
    device = trainer.strategy.root_device
    replay_device, _ = replay_placement(cfg.replay, device)
    eval_env = cli.env_from_config(cfg, cfg.seed + EVAL_SEED_OFFSET)
    try:
        check_sizes(cfg, eval_env, replay_device, device, trainer.world_size, fresh)
    finally:
        eval_env.close()


def build_run(
    cfg: Any,
    resume_from: Path | None = None,
    *,
    stop: Any = None,
    resume_world: int | None = None,
    loaded: dict[str, Any] | None = None,
    replays: dict[str, Any] | None = None,
) -> Run:
    """Build envs, replay, module, collector and Trainer for ``cfg``; writes nothing (nothing
    beyond what it checks: the replay fits in memory, the run directory can be written).

    With several processes (``trainer.devices``/``num_nodes``), each rank owns its environments,
    replay buffer and seed stream (seeds offset by 1000 per rank); the weights start identical.
    ``stop`` (a :class:`pixelsac.stopping.StopRequest`) adds the stop-on-signal callback;
    ``resume_world`` is the number of ranks that wrote the checkpoint resumed from; ``loaded``
    is that checkpoint as already loaded and checked, which the Trainer restores from instead of
    reading ``resume_from`` again (see :class:`RunDirCheckpointIO`); ``replays`` its replay files
    likewise (:func:`pixelsac.checkpoint.check_resumable`).
    """
    import torch
    from lightning.pytorch.callbacks import TQDMProgressBar
    from torch.utils.data import DataLoader

    from pixelsac.callbacks import (
        Checkpointer,
        Evaluator,
        PlainProgress,
        ProgressBar,
        StopWhenCollected,
        TrainingLogger,
    )
    from pixelsac.collect import Collector, ExperienceStream
    from pixelsac.envs.vector import make_envs
    from pixelsac.module import SACModule
    from pixelsac.perf import PerfTracker
    from pixelsac.replay import ReplaySet, replay_placement
    from pixelsac.stopping import StopOnSignal

    trainer = make_trainer(cfg)
    trainer.strategy.checkpoint_io = RunDirCheckpointIO(resume_from, loaded)
    rank, world = trainer.global_rank, trainer.world_size
    if resume_world is not None and resume_world != world:
        raise UsageError(
            f"{resume_from} was written by {resume_world} data-parallel rank(s), each with its own replay "
            f"and RNG states; this run has {world}: set trainer.devices and trainer.num_nodes to match"
        )
    replay_device, pin_memory = replay_placement(
        cfg.replay, trainer.strategy.root_device
    )  # fails before any env starts
    if cfg.perf.cuda_graphs:
        from pixelsac.graphs import graph_conflicts

        conflict = graph_conflicts(cfg, trainer.strategy.root_device.type, world)
        if conflict:
            raise ConfigError(conflict)
    run_dir = shared_run_dir(cfg, rank)
    if rank == 0:
        rundir.check_writable(run_dir)
        rundir.check_contents(run_dir)  # again under the lock (claim_run_dir); here before anything is built
    if rank == 0 and resume_from is None and cfg.resume != "auto":
        cli.check_out_dir(run_dir, cfg.overwrite, "run_dir", hint=f"resume={run_dir}")
    elif rank == 0 and resume_from is None and not cfg.overwrite and not cli.out_dir_is_free(run_dir):
        if not (run_dir / "config.yaml").is_file():  # a previous attempt that saved no checkpoint is fine
            raise UsageError(
                f"run_dir {run_dir} is not empty and holds no pixelsac run (no config.yaml, no "
                "checkpoint); resume=auto starts only in an empty directory or an earlier attempt's: "
                "choose another run_dir=... or pass overwrite=true"
            )
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    L.seed_everything(cfg.seed, verbose=False)

    # the checks that need no image come before the first render, whose renderer line would
    # otherwise precede their one-line error
    eval_env = cli.env_from_config(cfg, cfg.seed + EVAL_SEED_OFFSET)
    try:
        check_sizes(cfg, eval_env, replay_device, trainer.strategy.root_device, world, fresh=resume_from is None)
    except ConfigError:
        eval_env.close()
        raise
    eval_env.render(16)  # a missing GL library fails here, before anything is written (no RNG drawn)
    rank_seed = cfg.seed + RANK_SEED_STRIDE * rank
    seeds = [rank_seed + i for i in range(cfg.env.num_envs)]
    # overlapping the step with the updates needs the step to run elsewhere: in worker processes
    overlap = bool(cfg.train.overlap_collection)
    env = make_envs(cfg.task, seeds, parallel=cfg.env.num_envs > 1 or overlap, **cli.env_kwargs(cfg))

    replay = ReplaySet(
        cfg.env.num_envs,
        cfg.replay.capacity,
        env.frame_shape,
        env.frame_dtype,
        env.frame_stack,
        env.action_dim,
        device=replay_device,
        pin_memory=pin_memory,
    )
    module = SACModule(stored_config(cfg), env.obs_shape, env.action_dim)
    if rank > 0:  # identical initial weights everywhere; each rank augments and samples its own way
        torch.manual_seed(rank_seed)
    rng = np.random.default_rng(rank_seed)
    seed_steps = -(-cfg.train.seed_steps // world)  # like the budget, seed steps count over all ranks
    collector = Collector(env, replay, module.act, seed_steps, rng, world_size=world)
    total_agent_steps = -(-cfg.train.env_frames // (env.action_repeat * world))  # the budget is over all ranks
    stream = ExperienceStream(
        collector, cfg.agent.batch_size, total_agent_steps, cfg.train.updates_per_step, rng, overlap=overlap
    )

    eval_worker = None
    if (
        cfg.train.eval_in_worker
        and cfg.train.eval_episodes > 0
        and world == 1
        and trainer.strategy.root_device.type == "cpu"
    ):
        from pixelsac.eval_worker import EvalWorker

        # the same threads as here: the conv kernels, hence the actions, may depend on them
        eval_worker = EvalWorker(
            stored_config(cfg), env.obs_shape, env.action_dim, cfg.seed + EVAL_SEED_OFFSET, torch.get_num_threads()
        )
    episode_steps = -(-cfg.env.episode_frames // env.action_repeat) * cfg.env.num_envs
    checkpointer = Checkpointer(
        run_dir, collector, cfg.checkpoint.save_replay, max_wait_steps=episode_steps, stop=stop, replays=replays
    )
    evaluator = Evaluator(
        eval_env,
        collector,
        checkpointer,
        cfg.train.eval_every_frames,
        cfg.train.eval_episodes,
        video_dir=run_dir / "videos",
        video_every_evals=cfg.train.video_every_evals,
        video_size=min(cfg.train.video_size, 480),
        stop=stop,
        worker=eval_worker,
    )
    callbacks = [TrainingLogger(collector), evaluator, checkpointer, StopWhenCollected(stream)]
    stopper = None
    if stop is not None:
        stopper = StopOnSignal(
            stop, stream, collector, checkpointer, cfg.stop.max_wait_steps, cfg.stop.max_wait_seconds
        )
        callbacks.append(stopper)
    # our bar (frames first) replaces Lightning's default one; in a log that is not a terminal,
    # a plain line every train.progress_every_seconds replaces the bar
    bars = [i for i, c in enumerate(trainer.callbacks) if isinstance(c, TQDMProgressBar)]
    for i in bars:
        trainer.callbacks[i] = (
            ProgressBar(collector)
            if progress_is_a_terminal()
            else PlainProgress(collector, cfg.train.env_frames, cfg.train.progress_every_seconds, evaluator)
        )
    trainer.callbacks.extend(callbacks)
    if cfg.perf.track:  # first: its update clock must stop before any other callback's batch-end work
        trainer.callbacks.insert(0, PerfTracker(collector, run_dir, cfg))
    # its own generator: creating the loader's iterator must not draw from the global torch RNG,
    # or a resumed run would diverge from the uninterrupted one
    stream_loader = DataLoader(stream, batch_size=None, num_workers=0, generator=torch.Generator())
    return Run(
        cfg,
        run_dir,
        env,
        eval_env,
        replay,
        module,
        collector,
        stream_loader,
        trainer,
        resume_from,
        stopper,
        eval_worker,
    )


def progress_is_a_terminal() -> bool:
    """Whether the bar's stream (stderr, where tqdm draws) is a terminal."""
    return sys.stderr.isatty()


def attach_loggers(run: Run, resume_frames: int | None, pending_eval_frames: int | None = None) -> None:
    """CSV (``metrics.csv``) and TensorBoard (``tb/``) loggers in the run directory, attached
    once ``fit`` has restored the checkpoint and its replay (:class:`pixelsac.logs.LoggersAfterRestore`): a
    resume that fails to load leaves the logs as they were. On resume the CSV keeps its rows up
    to the checkpoint's frame (later ones were never checkpointed), less the row of an evaluation
    the checkpoint holds as in flight (the resumed run logs it)."""
    run.trainer.callbacks.insert(0, logs.LoggersAfterRestore(run.run_dir, resume_frames, pending_eval_frames))


def write_run_dir(run: Run) -> None:
    """``config.yaml``, the configuration the run uses; a failed write leaves the earlier one whole."""
    from omegaconf import OmegaConf

    run.run_dir.mkdir(parents=True, exist_ok=True)
    files.write_atomically(run.run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(stored_config(run.cfg))))


def claim_run_dir(run: Run, resume: Any = None) -> rundir.RunDirLock:
    """Lock the run directory (rank 0; held to the process's end) and check, under the lock, that
    it is still what the run was planned on: nothing the run writes there is a link or a special
    file (:func:`pixelsac.rundir.check_contents`), the checkpoint resumed from is the file loaded,
    and a fresh start finds no checkpoint another process wrote meanwhile. The temporary files of
    a killed attempt go. Then ``overwrite=true`` removes the earlier run's checkpoints, before
    anything else is written."""
    from pixelsac import checkpoint as ckpt

    lock = rundir.RunDirLock(run.run_dir).acquire()
    try:
        rundir.check_contents(run.run_dir)  # nothing the run writes is a link someone planted meanwhile
        rundir.remove_partial_files(run.run_dir)  # what a killed attempt's writes left
        if resume is not None and not resume.unchanged():
            raise UsageError(
                f"{resume.checkpoint} changed after it was loaded (another process wrote {run.run_dir}); "
                "run the command again"
            )
        if resume is None and run.resume_from is None and not run.cfg.overwrite:
            found = ckpt.in_run_dir(run.run_dir)
            if found is not None:
                raise UsageError(
                    f"{found} appeared after this run checked {run.run_dir} (another process wrote it); "
                    f"run the command again with resume=auto, or choose another run_dir=..."
                )
        if resume is None and run.resume_from is None and run.cfg.overwrite:
            rundir.clear_checkpoints(run.run_dir)
    except BaseException:
        lock.release()
        raise
    return lock


class RunDirCheckpointIO(TorchCheckpointIO):
    """How the Trainer reads and writes checkpoints in a pixelsac run.

    Writing: straight into the path given (the Checkpointer's temporary name in the run
    directory, which it then renames), with :func:`pixelsac.checkpoint.write_file` -- not
    Lightning's default, which builds the file under the system temporary folder and copies it
    across filesystems, and whose failures are tracebacks. Reading: the checkpoint a resumed run
    continues from was loaded and checked once already (weights-only, or trusted because the
    command line said so); that dict is what the Trainer restores, so a file swapped in after the
    check is never read. Any other path is read weights-only.
    """

    def __init__(self, resume_from: Path | None = None, loaded: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._resume_from = Path(resume_from) if resume_from is not None else None
        self._loaded = loaded

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        from pixelsac.checkpoint import write_file

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_file(checkpoint, Path(path))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if self._loaded is not None and self._resume_from is not None and Path(path) == self._resume_from:
            loaded, self._loaded = self._loaded, None  # handed over once; the Trainer holds it from here
            return loaded
        return super().load_checkpoint(path, weights_only=True)
