"""Trainer callbacks: training logs, periodic evaluation and checkpoints.

Every logged row carries the three step counts of the benchmark (``env_frames``,
``agent_steps``, ``updates``) and is written with ``env_frames`` as its step, so TensorBoard's
x-axis and the CSV's ``step`` column are environment frames, the unit results are reported in.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
import numpy as np
import torch

from pixelsac.collect import Collector, run_episodes
from pixelsac.envs import DMCEnv


def _log(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def _counters(collector: Collector, module: Any) -> dict[str, float]:
    return {"env_frames": collector.env_frames, "agent_steps": collector.agent_steps, "updates": module.updates}


class TrainingLogger(L.Callback):
    """Losses, temperature, entropy, loss scales, skipped steps and episode returns."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self._last_time = time.perf_counter()
        self._last_frames = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        counters = _counters(self.collector, module)
        for episode in self.collector.drain_episodes():
            _log(trainer, {"train/episode_return": episode.ret, "train/episode_length": episode.length,
                           "env_frames": episode.env_frames}, step=episode.env_frames)
            module.log("return", episode.ret, prog_bar=True, logger=False)
        if module.metrics:
            metrics, module.metrics = module.metrics, {}
            row = {f"train/{k}": float(v) for k, v in metrics.items()}  # one host sync per log interval
            for name, scale in module.loss_scales().items():
                row[f"lowp/loss_scale_{name}"] = scale
            for name, count in module.skipped.items():
                row[f"lowp/skipped_{name}"] = count
            now = time.perf_counter()
            row["perf/env_frames_per_s"] = (counters["env_frames"] - self._last_frames) / max(now - self._last_time, 1e-9)
            self._last_time, self._last_frames = now, counters["env_frames"]
            _log(trainer, {**row, **counters}, step=counters["env_frames"])
            module.log("critic_loss", row["train/critic_loss"], prog_bar=True, logger=False)


class ProgressBar(TQDMProgressBar):
    """Lightning's bar, with the env-frame count first and printed as an integer."""

    def __init__(self, collector: Collector) -> None:
        super().__init__()
        self.collector = collector

    def get_metrics(self, trainer: L.Trainer, module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, module)
        metrics.pop("v_num", None)
        return {"frames": str(self.collector.env_frames), **metrics}


class Evaluator(L.Callback):
    """Every ``every_frames`` env frames (and at the end): deterministic episodes on a separate
    environment, ``eval/return`` logged, ``last.ckpt`` written and ``best.ckpt`` when it improves."""

    def __init__(self, env: DMCEnv, collector: Collector, run_dir: Path, every_frames: int, episodes: int) -> None:
        self.env, self.collector = env, collector
        self.checkpoint_dir = Path(run_dir) / "checkpoints"
        self.every_frames, self.episodes = every_frames, episodes
        self.next_eval = every_frames
        self.best_return = -math.inf
        self.last_eval_frames = -1

    def state_dict(self) -> dict[str, Any]:
        return {"next_eval": self.next_eval, "best_return": self.best_return, "last_eval_frames": self.last_eval_frames}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_eval = int(state["next_eval"])
        self.best_return = float(state["best_return"])
        self.last_eval_frames = int(state["last_eval_frames"])

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.collector.env_frames >= self.next_eval:
            self.evaluate(trainer, module)
            while self.next_eval <= self.collector.env_frames:
                self.next_eval += self.every_frames

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        if self.collector.env_frames != self.last_eval_frames:
            self.evaluate(trainer, module)

    def evaluate(self, trainer: L.Trainer, module: Any) -> None:
        frames = self.collector.env_frames
        self.last_eval_frames = frames
        metrics: dict[str, float] = {}
        if self.episodes > 0:
            start = time.perf_counter()
            returns = run_episodes(self.env, module.act, self.episodes) if trainer.is_global_zero else [math.nan]
            mean = float(np.mean(returns))
            metrics = {"eval/return": mean, "eval/return_std": float(np.std(returns)),
                       "eval/seconds": time.perf_counter() - start}
            if trainer.is_global_zero:
                _log(trainer, {**metrics, **_counters(self.collector, module)}, step=frames)
            # only rank 0 evaluates; every rank must agree on saving (saving is collective)
            improved = bool(trainer.strategy.broadcast(mean > self.best_return, src=0))
            if improved:
                self.best_return = float(trainer.strategy.broadcast(mean, src=0))
        else:
            improved = False
        for logger in trainer.loggers:
            logger.save()
        self.save(trainer, "last.ckpt")
        if improved:
            self.save(trainer, "best.ckpt")

    def save(self, trainer: L.Trainer, name: str) -> None:
        """Write a Lightning checkpoint beside a temporary name, then rename it into place, so a
        crash mid-write never leaves a half-written ``last.ckpt``."""
        path = self.checkpoint_dir / name
        tmp = path.with_name(f".{name}.tmp")
        if trainer.is_global_zero:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(tmp, weights_only=False)  # full state: optimizers, scalers, loops
        if trainer.is_global_zero:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
