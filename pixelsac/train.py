"""Train pixel SAC (DrQ) on DeepMind Control::

    python -m pixelsac.train task=cheetah_run
    python -m pixelsac.train preset=tiny precision=fp32 seed=3
    python -m pixelsac.train task=walker_walk agent.batch_size=256 trainer.devices=2

Arguments are ``key=value`` overrides of ``conf/config.yaml`` (see the README). A mistake in
them, an unknown task or a missing OpenGL library is reported in one line with exit code 2,
before anything is written.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pixelsac.config import ConfigError, load_config, to_plain

USAGE = __doc__


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


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's start-up chatter (tips, device lines, an experiment dir that holds our config,
    a single-process data loader) says nothing a pixelsac user can act on; our own lines say
    which device and precision run. Warnings that matter still show."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        for pattern in ("does not have many workers", "IterableDataset", "exists and is not empty",
                        "LeafSpec", "Total length of `DataLoader`"):
            warnings.filterwarnings("ignore", message=f".*{pattern}.*")
        yield


def default_run_dir(cfg: Any) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / cfg.task / f"{stamp}_{cfg.precision}_s{cfg.seed}"


def build_run(cfg: Any) -> Run:
    """Build envs, replay, module, collector and Trainer for ``cfg``; writes nothing."""
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from torch.utils.data import DataLoader

    from pixelsac.callbacks import Evaluator, ProgressBar, TrainingLogger
    from pixelsac.collect import Collector, ExperienceStream
    from pixelsac.envs import DMCEnv
    from pixelsac.module import SACModule
    from pixelsac.replay import ReplayBuffer

    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())) and not cfg.overwrite:
        raise UsageError(f"run directory {run_dir} already exists and is not empty; "
                         "choose another run_dir=... or pass overwrite=true")
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    L.seed_everything(cfg.seed, verbose=False)

    env_kwargs = dict(obs=cfg.env.obs, image_size=cfg.env.image_size, frame_stack=cfg.env.frame_stack,
                      action_repeat=cfg.env.action_repeat, camera_id=cfg.env.camera_id,
                      episode_frames=cfg.env.episode_frames)
    env = DMCEnv(cfg.task, seed=cfg.seed, **env_kwargs)
    env.reset()  # renders once: a missing GL library fails here, before anything is written
    eval_env = DMCEnv(cfg.task, seed=cfg.seed + 100_000, **env_kwargs)

    replay = ReplayBuffer(cfg.replay.capacity, env.frame_shape, env.frame_dtype, env.frame_stack, env.action_dim)
    module = SACModule(to_plain(cfg), env.obs_shape, env.action_dim)
    rng = np.random.default_rng(cfg.seed)
    collector = Collector(env, replay, module.act, cfg.train.seed_steps, rng)
    total_agent_steps = -(-cfg.train.env_frames // env.action_repeat)
    stream = ExperienceStream(collector, cfg.agent.batch_size, total_agent_steps, cfg.train.updates_per_step, rng)

    loggers = [CSVLogger(run_dir, name="", version=""), TensorBoardLogger(run_dir, name="tb", version="")]
    callbacks = [TrainingLogger(collector), ProgressBar(collector),
                 Evaluator(eval_env, collector, run_dir, cfg.train.eval_every_frames, cfg.train.eval_episodes)]
    trainer_args = dict(cfg.trainer)
    if not trainer_args.get("enable_progress_bar", True):
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    try:
        with _quiet_lightning():
            trainer = L.Trainer(**trainer_args, precision="32-true", logger=loggers, callbacks=callbacks,
                                enable_checkpointing=False, default_root_dir=run_dir)
    except Exception as exc:  # Lightning's own validation of accelerator/devices/strategy...
        raise UsageError(f"invalid trainer settings: {str(exc).splitlines()[0]}") from exc
    stream_loader = DataLoader(stream, batch_size=None, num_workers=0)
    return Run(cfg, run_dir, env, eval_env, replay, module, collector, stream_loader, trainer)


def write_run_dir(run: Run) -> None:
    from omegaconf import OmegaConf

    run.run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(run.cfg, run.run_dir / "config.yaml", resolve=True)


def train(cfg: Any) -> Run:
    """Build, announce and fit a run."""
    run = build_run(cfg)
    write_run_dir(run)
    policy = run.module.precision_policy
    print(f"run directory: {run.run_dir}")
    device = run.trainer.strategy.root_device
    print(f"task {cfg.task} from {cfg.env.obs}, action repeat {run.env.action_repeat}; "
          f"{run.trainer.world_size} x {device.type}; {policy.describe()}")
    print(run.replay.describe())
    if policy.is_pure_low and run.trainer.strategy.root_device.type == "cpu":
        print(f"warning: {cfg.precision} on a CPU is emulated and several times slower than fp32; "
              "use a GPU for real runs (precision=fp32 for a fast CPU run)")
    with _quiet_lightning():
        run.trainer.fit(run.module, train_dataloaders=run.stream)
    evaluator = next(c for c in run.trainer.callbacks if type(c).__name__ == "Evaluator")
    print(f"done: {run.collector.env_frames} env frames, {run.module.updates} updates, "
          f"best eval return {evaluator.best_return:.1f}; checkpoints in {run.run_dir / 'checkpoints'}")
    return run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE)
        return 0
    from pixelsac.envs import EnvError, available_tasks

    try:
        cfg = load_config(argv, valid_tasks=available_tasks())
        train(cfg)
    except (ConfigError, EnvError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
