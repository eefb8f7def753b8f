"""Trainer callbacks: training logs, periodic evaluation and checkpoints.

Every logged row carries the three step counts of the benchmark (``env_frames``,
``agent_steps``, ``updates``) and is written with ``env_frames`` as its step, so TensorBoard's
x-axis and the CSV's ``step`` column are environment frames, the unit results are reported in.
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
import numpy as np
import torch

from pixelsac.collect import Collector, run_episodes
from pixelsac.envs import DMCEnv
from pixelsac.video import EpisodeRecorder


def _log(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def _counters(collector: Collector, module: Any) -> dict[str, float]:
    return {"env_frames": collector.total_env_frames, "agent_steps": collector.total_agent_steps,
            "updates": module.updates}


class TrainingLogger(L.Callback):
    """Losses, temperature, entropy, loss scales, skipped steps and episode returns."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        counters = _counters(self.collector, module)
        for episode in self.collector.drain_episodes():
            _log(trainer, {"train/episode_return": episode.ret, "train/episode_length": episode.length,
                           "env_frames": episode.env_frames}, step=episode.env_frames)
            module.log("return", episode.ret, prog_bar=True, logger=False, batch_size=1)
        if module.metrics:
            metrics, module.metrics = module.metrics, {}
            row = {f"train/{k}": float(v) for k, v in metrics.items()}  # one host sync per log interval
            for name, scale in module.loss_scales().items():
                row[f"lowp/loss_scale_{name}"] = scale
            for name, count in module.skipped.items():
                row[f"lowp/skipped_{name}"] = count
            _log(trainer, {**row, **counters}, step=counters["env_frames"])
            module.log("critic_loss", row["train/critic_loss"], prog_bar=True, logger=False, batch_size=1)


class ProgressBar(TQDMProgressBar):
    """Lightning's bar, with the env-frame count first and printed as an integer."""

    def __init__(self, collector: Collector) -> None:
        super().__init__()
        self.collector = collector

    def get_metrics(self, trainer: L.Trainer, module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, module)
        metrics.pop("v_num", None)
        return {"frames": str(self.collector.total_env_frames), **metrics}


class StopWhenCollected(L.Callback):
    """Ends ``fit`` once the experience stream has collected its budget. The Trainer runs with
    unlimited epochs so that a resumed run -- even from a checkpoint written after the last
    epoch ended -- continues as long as the (possibly raised) budget allows."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def on_train_epoch_end(self, trainer: L.Trainer, module: Any) -> None:
        if self.stream.exhausted:
            trainer.should_stop = True


class Evaluator(L.Callback):
    """Every ``every_frames`` env frames (and at the end): deterministic episodes on a separate
    environment, ``eval/return`` logged, and a checkpoint requested from the :class:`Checkpointer`
    (``best`` too when the return improved)."""

    def __init__(self, env: DMCEnv, collector: Collector, checkpointer: "Checkpointer",
                 every_frames: int, episodes: int, video_dir: Path | None = None,
                 video_every_evals: int = 0, video_size: int = 256) -> None:
        self.env, self.collector, self.checkpointer = env, collector, checkpointer
        self.every_frames, self.episodes = every_frames, episodes
        self.video_dir, self.video_every_evals, self.video_size = video_dir, video_every_evals, video_size
        self.next_eval = every_frames
        self.best_return = -math.inf
        self.last_eval_frames = -1
        self.evaluations = 0

    def state_dict(self) -> dict[str, Any]:
        return {"next_eval": self.next_eval, "best_return": self.best_return, "evaluations": self.evaluations,
                "last_eval_frames": self.last_eval_frames, "env_rng": self.env.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_eval = int(state["next_eval"])
        self.best_return = float(state["best_return"])
        self.last_eval_frames = int(state["last_eval_frames"])
        self.evaluations = int(state.get("evaluations", 0))
        self.env.set_rng_state(state["env_rng"])

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.collector.total_env_frames >= self.next_eval:
            self.checkpointer.request(best=self.evaluate(trainer, module))
            while self.next_eval <= self.collector.total_env_frames:
                self.next_eval += self.every_frames

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        best = self.evaluate(trainer, module) if self.collector.total_env_frames != self.last_eval_frames else False
        self.checkpointer.request(best=best)
        self.checkpointer.save_pending(trainer, module)  # at the end, boundary or not

    def evaluate(self, trainer: L.Trainer, module: Any) -> bool:
        """Run the eval episodes; True when the mean return is the best so far (on every rank)."""
        frames = self.collector.total_env_frames
        self.last_eval_frames = frames
        if self.episodes <= 0:
            return False
        start = time.perf_counter()
        self.evaluations += 1
        film = bool(self.video_dir and self.video_every_evals and self.evaluations % self.video_every_evals == 1 % self.video_every_evals)
        recorder = EpisodeRecorder(size=self.video_size, episodes={0}) if film and trainer.is_global_zero else None
        returns = run_episodes(self.env, module.act, self.episodes, on_frame=recorder) if trainer.is_global_zero else [math.nan]
        if recorder is not None:
            recorder.save(self.video_dir / f"eval_{frames:09d}.mp4")
        mean = float(np.mean(returns))
        if trainer.is_global_zero:
            _log(trainer, {"eval/return": mean, "eval/return_std": float(np.std(returns)),
                           "eval/seconds": time.perf_counter() - start, **_counters(self.collector, module)}, step=frames)
            for logger in trainer.loggers:
                logger.save()
        # only rank 0 evaluates; every rank must agree on saving (saving is collective)
        improved = bool(trainer.strategy.broadcast(mean > self.best_return, src=0))
        if improved:
            self.best_return = float(trainer.strategy.broadcast(mean, src=0))
        return improved


class Checkpointer(L.Callback):
    """Writes ``checkpoints/last.ckpt`` (and ``best.ckpt``) when asked, and owns what a
    checkpoint holds beyond the module and optimizers: collector counters, env and global RNG
    states and, with ``save_replay``, the replay buffer (a separate file per checkpoint).

    A requested checkpoint is written at the next episode boundary of the training env, where
    the collection state is complete without the physics of an episode in progress: resuming
    from it reproduces the uninterrupted run bit for bit (CPU, deterministic settings). Files
    are written under a temporary name, fsynced and renamed, so a crash mid-write leaves the
    previous checkpoint intact; a checkpoint whose weights are not finite is never written.
    """

    def __init__(self, run_dir: Path, collector: Collector, save_replay: bool, max_wait_steps: int = 10**9) -> None:
        self.folder = Path(run_dir) / "checkpoints"
        self.collector = collector
        self.save_replay = save_replay
        # with several envs whose episodes end at different times (terminations), a common
        # boundary may never come: after an episode's worth of steps, save anyway (inexact resume)
        self.max_wait_steps = max_wait_steps
        self._pending_since = 0
        self._pending: set[str] = set()
        self._replay_file: str | None = None
        self.restored_replay: str | None = None

    # --- what a checkpoint holds (Lightning stores it under this callback's key) -----------------
    def state_dict(self) -> dict[str, Any]:
        cuda = [t for t in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
        return {
            "collector": self.collector.state_dict(),
            "torch_rng": torch.get_rng_state(), "cuda_rng": cuda,
            "python_rng": random.getstate(),
            "replay_file": self._replay_file,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collector.load_state_dict(state["collector"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        random.setstate(state["python_rng"])
        self._replay_file = state["replay_file"]
        if self._replay_file is not None:
            path = self.folder / self._replay_file
            if not path.is_file():
                raise FileNotFoundError(f"the checkpoint's replay buffer {path} is missing")
            self.collector.replay.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            self.restored_replay = str(path)

    # --- when -------------------------------------------------------------------------------------
    def request(self, best: bool) -> None:
        if not self._pending:
            self._pending_since = self.collector.agent_steps
        self._pending.add("last.ckpt")
        if best:
            self._pending.add("best.ckpt")

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        waited = self.collector.agent_steps - self._pending_since
        if self._pending and (self.collector.at_episode_boundary or waited > self.max_wait_steps):
            self.save_pending(trainer, module)

    def save_pending(self, trainer: L.Trainer, module: Any) -> None:
        if not self._pending:
            return
        names, self._pending = sorted(self._pending, reverse=True), set()  # last before best
        self.save(trainer, module, names)

    def on_exception(self, trainer: L.Trainer, module: Any, exception: BaseException) -> None:
        """On a numerical failure with finite weights (a collapsed loss scale), keep that state."""
        from pixelsac.precision import NumericalFailure

        if isinstance(exception, NumericalFailure):
            exception.env_frames = self.collector.total_env_frames
            if exception.weights_finite:
                self.save(trainer, module, ["last.ckpt"])
                exception.checkpoint = str(self.folder / "last.ckpt")
            elif (self.folder / "last.ckpt").is_file():
                exception.checkpoint = str(self.folder / "last.ckpt")

    # --- how --------------------------------------------------------------------------------------
    def save(self, trainer: L.Trainer, module: Any, names: list[str]) -> None:
        if not module.weights_are_finite():
            return  # never write a checkpoint that cannot be trained on; the health check reports it
        zero = trainer.is_global_zero
        if zero:
            self.folder.mkdir(parents=True, exist_ok=True)
        if self.save_replay and "last.ckpt" in names and zero:
            self._replay_file = f"replay-{self.collector.agent_steps:010d}.pt"
            _atomic_torch_save(self.collector.replay.state_dict(), self.folder / self._replay_file)
        for name in names:
            path = self.folder / name
            tmp = path.with_name(f".{name}.tmp")
            trainer.save_checkpoint(tmp, weights_only=False)  # collective: every rank calls it
            if zero:
                _fsync_and_replace(tmp, path)
        if zero and self.save_replay and "last.ckpt" in names:
            # earlier replay files belonged to earlier last.ckpt files (or to a save cut short)
            for stale in self.folder.glob("replay-*.pt"):
                if stale.name != self._replay_file:
                    stale.unlink(missing_ok=True)


def _fsync_and_replace(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must reach the disk
    finally:
        os.close(dir_fd)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    _fsync_and_replace(tmp, path)
