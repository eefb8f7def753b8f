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
import uuid
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ProgressBar as LightningProgressBar
from lightning.pytorch.callbacks import TQDMProgressBar

from pixelsac.checkpoint import REPLAY_OWNER, load_replay, replay_owner, save_atomically
from pixelsac.collect import Collector, run_episodes
from pixelsac.envs import DMCEnv
from pixelsac.files import move_into_place
from pixelsac.logs import log_metrics
from pixelsac.stopping import StopRequest
from pixelsac.video import EpisodeRecorder


def _counters(collector: Collector, module: Any) -> dict[str, float]:
    return {
        "env_frames": collector.total_env_frames,
        "agent_steps": collector.total_agent_steps,
        "updates": module.updates,
    }


class TrainingLogger(L.Callback):
    """Losses, temperature, entropy, loss scales, skipped steps and episode returns.

    :attr:`progress` keeps the latest episode return and critic loss as host floats for the
    progress bar (read when it redraws): handed to ``module.log(prog_bar=True)`` they would
    become device tensors that Lightning reads back with ``.item()`` at every redraw.
    """

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.progress: dict[str, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        counters = _counters(self.collector, module)
        for episode in self.collector.drain_episodes():
            log_metrics(
                trainer,
                {
                    "train/episode_return": episode.ret,
                    "train/episode_length": episode.length,
                    "env_frames": episode.env_frames,
                },
                step=episode.env_frames,
            )
            self.progress["return"] = float(episode.ret)
        if module.metrics:
            metrics, module.metrics = module.metrics, {}
            row = {f"train/{k}": float(v) for k, v in metrics.items()}  # one host sync per log interval
            for name, scale in module.loss_scales().items():
                row[f"lowp/loss_scale_{name}"] = scale
            for name, count in module.skipped.items():
                row[f"lowp/skipped_{name}"] = count
            records, notes = module.lowp_records()
            row.update({f"lowp/{name}": value for name, value in records.items()})
            for note in notes:
                print(f"pixelsac: {note}", flush=True)
            log_metrics(trainer, {**row, **counters}, step=counters["env_frames"])
            self.progress["critic_loss"] = row["train/critic_loss"]


class ProgressBar(TQDMProgressBar):
    """Lightning's bar showing the env-frame count (an integer), the latest episode return and
    critic loss. It is read only when the bar redraws, from values the host already holds
    (:attr:`TrainingLogger.progress`): never a device read per update."""

    def __init__(self, collector: Collector) -> None:
        super().__init__()
        self.collector = collector

    def get_metrics(self, trainer: L.Trainer, module: Any) -> dict[str, Any]:
        # not Lightning's trainer.progress_bar_metrics: it converts logged tensors with .item()
        logger = next((c for c in trainer.callbacks if isinstance(c, TrainingLogger)), None)
        return {"frames": str(self.collector.total_env_frames), **(logger.progress if logger else {})}


class PlainProgress(LightningProgressBar):
    """Progress for a log that is not a terminal (nohup, CI, SLURM): one plain line every
    ``every_seconds`` -- env frames of the budget, updates, frames/s since the last line, the
    latest evaluation -- instead of a bar redrawn with a carriage return on every update."""

    def __init__(
        self,
        collector: Collector,
        budget_frames: int,
        every_seconds: float = 30.0,
        evaluator: Evaluator | None = None,
        clock: Any = time.monotonic,
        out: Any = print,
    ) -> None:
        super().__init__()
        self.collector, self.budget_frames, self.every_seconds = collector, budget_frames, every_seconds
        self.evaluator = evaluator
        self._clock, self._out = clock, out
        self._enabled = True
        self._last_time: float | None = None
        self._last_frames = 0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._last_time, self._last_frames = self._clock(), self.collector.total_env_frames

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = self._clock()
        if not self._enabled or self._last_time is None or now - self._last_time < self.every_seconds:
            return
        self._out(self.line(trainer, pl_module, now), flush=True)

    def line(self, trainer: L.Trainer, pl_module: Any, now: float) -> str:
        frames = self.collector.total_env_frames
        rate = (frames - self._last_frames) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_frames = now, frames
        share = f" ({frames / self.budget_frames:.0%})" if self.budget_frames > 0 else ""
        text = (
            f"progress: env frames {frames:,}/{self.budget_frames:,}{share}, "
            f"updates {getattr(pl_module, 'updates', 0):,}, {rate:,.1f} frames/s"
        )
        last_eval = getattr(self.evaluator, "last_return", None)
        if last_eval is not None:
            text += f", last eval return {last_eval:.1f}"
        return text


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
    (``best`` too when the return improved).

    With a ``stop`` request, a stop signal makes an evaluation in progress give up (it can take
    minutes): nothing is logged, the eval environment's RNG goes back to where the evaluation
    began, and the evaluation stays due. The run then stops right there (``stop.save_now``), so
    its checkpoint holds the weights the evaluation was for, and the resumed run evaluates first
    (:meth:`on_train_start`) -- the same episodes, the same return, the row the run would have
    logged. A final evaluation given up this way is what ``resume`` then runs.

    With a ``worker`` (:class:`pixelsac.eval_worker.EvalWorker`, ``train.eval_in_worker``), an
    evaluation that comes due is handed to the worker with a copy of the acting weights and the
    eval env's RNG state, and training goes on; one evaluation is in flight at a time. Its row is
    logged when the result comes back, at the frame it was taken at, with that frame's counters.
    The checkpoint requested for it is written when it would be without a worker (the next episode
    boundary) and kept aside as the candidate for ``best.ckpt``, which it becomes if the return
    improved: ``best.ckpt`` holds the same weights either way. A checkpoint written while an
    evaluation is in flight stores it (``pending``: its frame, weights and RNG state), and a run
    resumed from it evaluates it again first. The returns, videos, checkpoints' weights and the
    training itself are bit for bit those without a worker.
    """

    def __init__(
        self,
        env: DMCEnv,
        collector: Collector,
        checkpointer: Checkpointer,
        every_frames: int,
        episodes: int,
        video_dir: Path | None = None,
        video_every_evals: int = 0,
        video_size: int = 256,
        stop: StopRequest | None = None,
        worker: Any = None,
    ) -> None:
        self.env, self.collector, self.checkpointer, self.stop = env, collector, checkpointer, stop
        self.worker = worker
        # the evaluation in the worker: frames, acting weights, env RNG before it, counters, video
        self.pending: dict[str, Any] | None = None
        self.every_frames, self.episodes = every_frames, episodes
        self.video_dir, self.video_every_evals, self.video_size = video_dir, video_every_evals, video_size
        self.next_eval = every_frames
        self.best_return = -math.inf
        self.last_return: float | None = None  # of this process's latest evaluation (for progress lines)
        self.last_eval_frames = -1
        self.evaluations = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_eval": self.next_eval,
            "best_return": self.best_return,
            "evaluations": self.evaluations,
            "last_eval_frames": self.last_eval_frames,
            "env_rng": self.env.get_rng_state(),  # before the pending evaluation, if any
            "pending": self.pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_eval = int(state["next_eval"])
        self.best_return = float(state["best_return"])
        self.last_eval_frames = int(state["last_eval_frames"])
        self.evaluations = int(state.get("evaluations", 0))
        self.env.set_rng_state(state["env_rng"])
        self.pending = state.get("pending")

    def on_train_start(self, trainer: L.Trainer, module: Any) -> None:
        """An evaluation in flight when the checkpoint was written, or one that a stop gave up
        on, runs now, before any update changes the weights."""
        if self.pending is not None:
            self._resume_pending(trainer, module)
        if self.collector.total_env_frames >= self.next_eval:
            self._evaluate_due(trainer, module)
            if self.collector.at_episode_boundary:  # as the uninterrupted run saved right after it
                self.checkpointer.save_pending(trainer, module)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._collect(trainer, wait=False)
        if self.collector.total_env_frames >= self.next_eval:
            self._evaluate_due(trainer, module)

    def _evaluate_due(self, trainer: L.Trainer, module: Any) -> None:
        if self.worker is not None:
            self._collect(trainer, wait=True)  # one evaluation in flight at a time
            if self._submit(module):
                self.checkpointer.request(best=False, keep_candidate=True)
            else:
                self.checkpointer.request(best=False)
            while self.next_eval <= self.collector.total_env_frames:
                self.next_eval += self.every_frames
            return
        best = self.evaluate(trainer, module)
        if best is None:
            return  # given up on a stop signal: still due, and the run stops here
        self.checkpointer.request(best=best)
        while self.next_eval <= self.collector.total_env_frames:
            self.next_eval += self.every_frames

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        if self.stop is not None and self.stop.stopped:
            return  # stopped by a signal, saved by StopOnSignal: the final evaluation is for the real end
        if self.worker is not None:
            self._final_in_worker(trainer, module)
            return
        best = self.evaluate(trainer, module) if self.collector.total_env_frames != self.last_eval_frames else False
        if best is None and self.stop is not None:
            self.stop.gave_up_final_evaluation = True  # saved below all the same; a resume runs it
        self.checkpointer.request(best=bool(best))
        self.checkpointer.save_pending(trainer, module)  # at the end, boundary or not

    def evaluate(self, trainer: L.Trainer, module: Any) -> bool | None:
        """Run the eval episodes; True when the mean return is the best so far (on every rank).
        None (on every rank) when rank 0 gave up on a stop signal: no trace left, still due."""
        frames = self.collector.total_env_frames
        if self.episodes <= 0:
            self.last_eval_frames = frames
            return False
        zero = trainer.is_global_zero
        start = time.perf_counter()
        env_rng = self.env.get_rng_state() if zero and self.stop is not None else None
        recorder = EpisodeRecorder(size=self.video_size, episodes={0}) if self._film() and zero else None
        abandon = (lambda: self.stop.pending) if self.stop is not None else None
        returns = (
            run_episodes(self.env, module.act, self.episodes, on_frame=recorder, should_abandon=abandon)
            if zero
            else [math.nan]
        )
        mean = math.nan if returns is None else float(np.mean(returns))
        # only rank 0 evaluates; every rank must agree on saving (saving is collective)
        gave_up, improved, mean = trainer.strategy.broadcast((returns is None, mean > self.best_return, mean), src=0)
        if gave_up:
            if env_rng is not None:
                self.env.set_rng_state(env_rng)  # the resumed run plays the same episodes
            if self.stop is not None:
                self.stop.save_now = True
            return None
        if recorder is not None:
            recorder.save(self.video_dir / f"eval_{frames:09d}.mp4")
        self._record(
            trainer,
            frames,
            float(mean),
            returns if zero else None,
            time.perf_counter() - start,
            _counters(self.collector, module),
            bool(improved),
        )
        return bool(improved)

    def _record(
        self,
        trainer: L.Trainer,
        frames: int,
        mean: float,
        returns: list[float] | None,
        seconds: float,
        counters: dict[str, float],
        improved: bool,
    ) -> None:
        """An evaluation done: counters, best return, and its row (where ``returns`` are known)."""
        self.last_eval_frames = frames
        self.last_return = mean
        self.evaluations += 1
        if returns is not None:
            metrics = {"eval/return": mean, "eval/return_std": float(np.std(returns)), "eval/seconds": seconds}
            log_metrics(trainer, {**metrics, **counters}, step=frames)
            for logger in trainer.loggers:
                logger.save()
        if improved:
            self.best_return = mean

    # --- in the worker --------------------------------------------------------------------------
    def _film(self) -> bool:
        return bool(
            self.video_dir
            and self.video_every_evals
            and (self.evaluations + 1) % self.video_every_evals == 1 % self.video_every_evals
        )

    def _submit(self, module: Any) -> bool:
        """Hand the evaluation due now to the worker; False when there is none to run."""
        from pixelsac.eval_worker import acting_weights

        frames = self.collector.total_env_frames
        if self.episodes <= 0:
            self.last_eval_frames = frames
            return False
        self.pending = {
            "frames": frames,
            "weights": acting_weights(module),
            "env_rng": self.env.get_rng_state(),
            "counters": _counters(self.collector, module),
            "film": self._film(),
        }
        self._send()
        return True

    def _send(self) -> None:
        from pixelsac.eval_worker import EvalJob

        pending = self.pending
        video = None
        if pending["film"] and self.video_dir is not None:
            self.video_dir.mkdir(parents=True, exist_ok=True)
            video = str(self.video_dir / f"eval_{pending['frames']:09d}.mp4")
        self.worker.submit(
            EvalJob(pending["frames"], pending["weights"], pending["env_rng"], self.episodes, video, self.video_size)
        )

    def _resume_pending(self, trainer: L.Trainer, module: Any) -> None:
        self.checkpointer.adopt_candidate()
        if self.worker is None:  # resumed without a worker: evaluate the stored weights here
            self.worker = _InProcess(self.env, module)
            try:
                self._send()
                self._finish(trainer, self.worker.wait())
            finally:
                self.worker = None
            return
        self._send()

    def _collect(self, trainer: L.Trainer, wait: bool) -> bool | None:
        """Take the worker's result if there is one (``wait``: block for it); whether it improved."""
        if self.pending is None or self.worker is None or not self.worker.busy:
            return None
        result = self.worker.wait() if wait else self.worker.poll()
        if result is None:
            return None
        return self._finish(trainer, result)

    def _finish(self, trainer: L.Trainer, result: Any) -> bool | None:
        pending = self.pending
        if result.returns is None:  # given up (a stop signal during the final evaluation)
            return None
        self.pending = None
        mean = float(np.mean(result.returns))
        self.env.set_rng_state(result.env_rng)
        improved = mean > self.best_return
        self._record(trainer, pending["frames"], mean, result.returns, result.seconds, pending["counters"], improved)
        self.checkpointer.resolve_candidate(improved)
        return improved

    def _final_in_worker(self, trainer: L.Trainer, module: Any) -> None:
        """The end of the run: the evaluation in flight, then one at the last frame, then save."""
        self._collect(trainer, wait=True)
        if self.collector.total_env_frames != self.last_eval_frames and self._submit(module):
            result = self._wait_or_give_up()
            if self._finish(trainer, result) is None:
                self.stop.gave_up_final_evaluation = True  # pending stays in the checkpoint; a resume runs it
        self.checkpointer.request(best=False)
        self.checkpointer.save_pending(trainer, module)

    def _wait_or_give_up(self) -> Any:
        """The worker's result; a stop signal meanwhile cancels the evaluation (returns None)."""
        while True:
            result = self.worker.poll()
            if result is not None:
                return result
            if self.stop is not None and self.stop.pending:
                self.worker.cancel()
                return self.worker.wait()
            time.sleep(0.05)


class _InProcess:
    """The worker's interface, evaluating in this process (a pending evaluation resumed by a run
    without a worker)."""

    def __init__(self, env: DMCEnv, module: Any) -> None:
        self.env, self.module = env, module
        self.busy, self._job = False, None

    def submit(self, job: Any) -> None:
        self._job, self.busy = job, True

    def wait(self) -> Any:
        from pixelsac.eval_worker import acting_weights, play

        job, self.busy = self._job, False
        current = acting_weights(self.module)
        try:
            return play(self.env, self.module, job)
        finally:
            self.module.actor.load_state_dict(current["actor"])
            self.module.critic.trunk.load_state_dict(current["critic.trunk"])


class Checkpointer(L.Callback):
    """Writes ``checkpoints/last.ckpt`` (and ``best.ckpt``) when asked, and owns what a
    checkpoint holds beyond the module and optimizers: collector counters, env and global RNG
    states and, with ``save_replay``, the replay buffer (a separate file per checkpoint).

    A requested checkpoint is written at the next episode boundary of the training env, where
    the collection state is complete without the physics of an episode in progress: resuming
    from it reproduces the uninterrupted run bit for bit (CPU, deterministic settings). Files
    are written under a temporary name, fsynced and renamed, so a crash mid-write leaves the
    previous checkpoint intact; a checkpoint whose weights are not finite is never written.

    Under data parallelism every rank collects its own experience with its own RNG streams, so
    every rank's collection state goes into the checkpoint (``ranks``, gathered to rank 0, which
    writes the file) and every rank writes its own replay file (``replay-<step>-rank<r>.pt``
    beside rank 0's ``replay-<step>.pt``; the run directory must be on a filesystem all ranks
    share). A resume needs the same number of ranks, each taking back its own state.

    With a ``stop`` request, ``stop.saving`` is on while files are written: a stop signal then
    (the second one) exits at once rather than after the write (see :mod:`pixelsac.stopping`).

    A run has an id (:attr:`run_id`: chosen by rank 0 at a fresh start, kept across resumes),
    which every checkpoint records; each replay file records it too, with the agent step and rank
    it was written at (:func:`pixelsac.checkpoint.replay_owner`), so a replay file that is not its
    checkpoint's is refused. ``replays``: the resumed checkpoint's replay files as already loaded
    and checked (:func:`pixelsac.checkpoint.check_resumable`); restored from instead of the files.
    """

    def __init__(
        self,
        run_dir: Path,
        collector: Collector,
        save_replay: bool,
        max_wait_steps: int = 10**9,
        stop: StopRequest | None = None,
        replays: dict[str, Any] | None = None,
    ) -> None:
        self.folder = Path(run_dir) / "checkpoints"
        self.run_id = uuid.uuid4().hex
        self._checked_replays = replays if replays is not None else {}  # emptied once restored
        self.stop = stop
        self.collector = collector
        self.save_replay = save_replay
        # with several envs whose episodes end at different times (terminations), a common
        # boundary may never come: after an episode's worth of steps, save anyway (inexact resume)
        self.max_wait_steps = max_wait_steps
        self._pending_since = 0
        self._pending: set[str] = set()
        self._keep_candidate = self._candidate_ready = False  # see request(keep_candidate=True)
        self._replay_file: str | None = None
        self.restored_replay: str | None = None
        self.saved_at: tuple[int, int] | None = None  # (agent steps, updates) of the last last.ckpt written
        self.stopped_by: str | None = None  # the signal whose stop the next checkpoint records
        self._rank, self._world = 0, 1

    @property
    def last_path(self) -> Path:
        return self.folder / "last.ckpt"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._rank, self._world = trainer.global_rank, trainer.world_size
        self.run_id = trainer.strategy.broadcast(self.run_id, src=0)  # one id for every rank's files

    def _replay_name(self, rank: int) -> str:
        suffix = f"-rank{rank}" if rank else ""
        return f"replay-{self.collector.agent_steps:010d}{suffix}.pt"

    # --- what a checkpoint holds (Lightning stores it under this callback's key) -----------------
    def _own_state(self) -> dict[str, Any]:
        cuda = [t for t in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
        return {
            "collector": self.collector.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": cuda,
            "python_rng": random.getstate(),
            "replay_file": self._replay_file,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's collection state (rank 0's at the top level, as with one process), every
        rank's under ``ranks`` when there are several, and the signal that stopped the run."""
        state = self._own_state()
        if self._world > 1 and dist.is_available() and dist.is_initialized():
            ranks: list[Any] = [None] * self._world
            dist.all_gather_object(ranks, state)  # collective: Lightning builds the checkpoint on every rank
            state = {**ranks[0], "ranks": ranks}
        state["stopped_by"] = self.stopped_by
        state["run_id"] = self.run_id
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = state.get("ranks")
        if ranks is not None and len(ranks) != self._world:
            raise ValueError(
                f"the checkpoint holds the collection state of {len(ranks)} ranks; this run has "
                f"{self._world} (trainer.devices x trainer.num_nodes must match to resume)"
            )
        run_id = state.get("run_id")  # None: a checkpoint from before runs had an id (this run takes its new one)
        self.run_id = str(run_id) if run_id else self.run_id
        if ranks is not None:
            state = ranks[self._rank]
        self.collector.load_state_dict(state["collector"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        random.setstate(state["python_rng"])
        self._replay_file = state["replay_file"]
        if self._replay_file is not None:
            path = self.folder / self._replay_file
            replay = self._checked_replays.pop(self._replay_file, None)
            if replay is None:  # not checked before the run was built (a Trainer driven directly)
                owner = replay_owner(run_id, state["collector"]["agent_steps"], self._rank) if run_id else None
                replay = load_replay(path, self.last_path, owner)
            self.collector.replay.load_state_dict(replay)
            self.restored_replay = str(path)
        self._checked_replays.clear()  # copied into the ring: no file stays mapped (the other ranks' neither)

    # --- when -------------------------------------------------------------------------------------
    def request(self, best: bool, keep_candidate: bool = False) -> None:
        """Write ``last.ckpt`` (and ``best.ckpt``) at the next episode boundary. ``keep_candidate``:
        keep that ``last.ckpt`` aside too (a hard link), as the ``best.ckpt`` of an evaluation
        whose return is not known yet (:meth:`resolve_candidate`)."""
        if not self._pending:
            self._pending_since = self.collector.agent_steps
        self._pending.add("last.ckpt")
        if best:
            self._pending.add("best.ckpt")
        if keep_candidate:
            self._keep_candidate, self._candidate_ready = True, False

    @property
    def candidate_path(self) -> Path:
        return self.folder / ".best-candidate.ckpt"

    def resolve_candidate(self, improved: bool) -> None:
        """The evaluation the candidate was kept for has its return: it becomes ``best.ckpt`` if
        the return improved, else it goes. Not written yet: ``best.ckpt`` joins the pending write."""
        if self._candidate_ready:
            if self._rank == 0:
                if improved:
                    _fsync_and_replace(self.candidate_path, self.folder / "best.ckpt")
                else:
                    self.candidate_path.unlink(missing_ok=True)
        elif improved:
            self.request(best=True)
        self._keep_candidate = self._candidate_ready = False

    def adopt_candidate(self) -> None:
        """A resumed run's pending evaluation: its candidate is on disk if the earlier process
        wrote it, else the next ``last.ckpt`` becomes it."""
        self._candidate_ready = self.candidate_path.is_file()
        self._keep_candidate = not self._candidate_ready

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        waited = self.collector.agent_steps - self._pending_since
        if self._pending and (self.collector.at_episode_boundary or waited > self.max_wait_steps):
            self.save_pending(trainer, module)

    def save_pending(self, trainer: L.Trainer, module: Any) -> bool:
        """Write what was requested now, boundary or not; False when nothing was written."""
        if not self._pending:
            return False
        names, self._pending = sorted(self._pending, reverse=True), set()  # last before best
        return self.save(trainer, module, names)

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
    def save(self, trainer: L.Trainer, module: Any, names: list[str]) -> bool:
        """Write ``names`` (collective: every rank calls it); False when the weights are not finite."""
        if not module.weights_are_finite():
            return False  # never write a checkpoint that cannot be trained on; the health check reports it
        if self.stop is None:
            return self._write(trainer, module, names)
        self.stop.saving = True
        try:
            return self._write(trainer, module, names)
        finally:
            self.stop.saving = False

    def _write(self, trainer: L.Trainer, module: Any, names: list[str]) -> bool:
        # a step in flight (train.overlap_collection) is stored first: the replay file, its name
        # and the collection state must all hold the same steps
        self.collector.finish_step()
        zero = trainer.is_global_zero
        replay = self.save_replay and "last.ckpt" in names
        if zero or replay:
            self.folder.mkdir(parents=True, exist_ok=True)
        if replay:  # every rank its own, before the checkpoint that names them
            self._replay_file = self._replay_name(trainer.global_rank)
            owner = replay_owner(self.run_id, self.collector.agent_steps, trainer.global_rank)
            contents = {**self.collector.replay.state_dict(), REPLAY_OWNER: owner}
            save_atomically(contents, self.folder / self._replay_file)  # a failed write: OSError naming it
        for name in names:
            path = self.folder / name
            tmp = path.with_name(f".{name}.tmp")
            trainer.save_checkpoint(tmp, weights_only=False)  # collective, and ends with a barrier
            if zero:
                _fsync_and_replace(tmp, path)
        if "last.ckpt" in names:
            self.saved_at = (self.collector.agent_steps, module.updates)
            if self._keep_candidate:
                if zero:  # a hard link: the next last.ckpt replaces the name, not these bytes
                    link = self.candidate_path.with_name(".best-candidate.ckpt.tmp")
                    link.unlink(missing_ok=True)
                    os.link(self.folder / "last.ckpt", link)
                    os.replace(link, self.candidate_path)
                self._keep_candidate, self._candidate_ready = False, True
        if zero and replay:
            # earlier replay files belonged to earlier last.ckpt files (or to a save cut short);
            # every rank has written its current one: save_checkpoint's barrier came after
            current = {self._replay_name(rank) for rank in range(trainer.world_size)}
            for stale in [*self.folder.glob("replay-*.pt"), *self.folder.glob(".replay-*.pt.tmp")]:
                if stale.name not in current:
                    stale.unlink(missing_ok=True)
        return True


def _fsync_and_replace(tmp: Path, path: Path) -> None:
    move_into_place(tmp, path)  # fsynced, renamed, and the rename itself reaches the disk
