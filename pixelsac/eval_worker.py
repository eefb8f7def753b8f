"""Evaluation episodes in a worker process while training goes on (``train.eval_in_worker``).

An evaluation is a pure function of the policy's weights and the evaluation environment's RNG
state: ``(actor, critic trunk, env RNG) -> (returns, env RNG after)``. It draws nothing from the
training process's RNG streams and changes nothing the updates read, so it can run beside them.
On a CPU the update uses one core and software rendering is most of an evaluation's cost: a
worker on the second core takes the evaluation episodes off the training loop's wall time.

The worker builds the same agent from the same configuration on the CPU, with the same precision
policy, memory layout and thread count as the training process, and plays the episodes with the
same :func:`pixelsac.collect.run_episodes` and :meth:`SACModule.act`: the returns, the filmed
frames and the RNG state it hands back are bit for bit those of an evaluation in the training
process (tests/test_eval_worker.py checks this on whole runs). It is started with ``spawn`` (a
fresh interpreter: forking a process that holds OpenGL contexts is not safe), ignores the stop
signals its parent handles, ends when the parent closes it, and is killed when the parent ends,
however it ends (:mod:`pixelsac.lifeline`).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from pixelsac import lifeline
from pixelsac.envs.vector import EnvWorkerError, ignore_parents_signals, receive_from


def acting_weights(module: Any) -> dict[str, dict[str, torch.Tensor]]:
    """A CPU copy of the weights :meth:`SACModule.act` uses (the actor and the conv trunk)."""
    parts = {"actor": module.actor, "critic.trunk": module.critic.trunk}
    return {
        name: {k: v.detach().to("cpu", copy=True) for k, v in part.state_dict().items()} for name, part in parts.items()
    }


@dataclass
class EvalJob:
    """One evaluation: the weights at ``frames``, the eval env's RNG state before it, and where
    to write the filmed first episode (None: no video)."""

    frames: int
    weights: dict[str, dict[str, torch.Tensor]]
    env_rng: dict
    episodes: int
    video_path: str | None = None
    video_size: int = 256


@dataclass
class EvalResult:
    frames: int
    returns: list[float] | None  # None: abandoned (cancel)
    env_rng: dict | None  # the eval env's RNG state after the episodes
    seconds: float


def _build(config: dict[str, Any], obs_shape: tuple[int, ...], action_dim: int, seed: int) -> tuple[Any, Any]:
    from pixelsac import cli
    from pixelsac.config import from_plain
    from pixelsac.module import SACModule

    cfg = from_plain(config)
    env = cli.env_from_config(cfg, seed)
    module = SACModule(config, obs_shape, action_dim)
    # what SACModule.setup does for a CPU run (the layout decides the conv kernels, hence the bits)
    module.use_device("cpu")
    return env, module.eval()


def play(env: Any, module: Any, job: EvalJob, should_abandon: Callable[[], bool] | None = None) -> EvalResult:
    """``job``'s episodes on ``env`` with ``module`` acting with the job's weights (loaded into it)
    from the job's RNG state; films the first episode where the job asks. Returns None as the
    returns when ``should_abandon()`` said so."""
    from pixelsac.collect import run_episodes
    from pixelsac.video import EpisodeRecorder

    start = time.perf_counter()
    module.actor.load_state_dict(job.weights["actor"])
    module.critic.trunk.load_state_dict(job.weights["critic.trunk"])
    env.set_rng_state(job.env_rng)
    recorder = EpisodeRecorder(size=job.video_size, episodes={0}) if job.video_path else None
    returns = run_episodes(env, module.act, job.episodes, on_frame=recorder, should_abandon=should_abandon)
    if returns is None:
        return EvalResult(job.frames, None, None, time.perf_counter() - start)
    if recorder is not None:
        recorder.save(Path(job.video_path))
    return EvalResult(job.frames, returns, env.get_rng_state(), time.perf_counter() - start)


def _serve(
    conn: Connection,
    cancel: Any,
    config: dict[str, Any],
    obs_shape: tuple[int, ...],
    action_dim: int,
    seed: int,
    num_threads: int | None,
) -> None:
    """The worker: build the env and agent, then play each job sent until told to close."""
    ignore_parents_signals()
    try:
        if num_threads:
            torch.set_num_threads(num_threads)
        env, module = _build(config, obs_shape, action_dim, seed)
        conn.send(("ok", None))
    except BaseException as exc:  # noqa: BLE001 -- report anything, including EnvError
        conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    try:
        while True:
            command, job = conn.recv()
            if command == "close":
                env.close()
                return
            try:
                conn.send(("ok", play(env, module, job, should_abandon=cancel.is_set)))
            except BaseException as exc:  # noqa: BLE001
                conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the parent went away


class EvalWorker:
    """A process that plays evaluation episodes; one job at a time.

    ``submit(job)`` hands it a job and returns at once; ``poll()`` gives the result when it is
    ready (else None), ``wait()`` blocks for it; ``cancel()`` makes a job in progress give up
    (its result then has ``returns=None``); ``close()`` ends the process.
    """

    def __init__(
        self,
        config: dict[str, Any],
        obs_shape: tuple[int, ...],
        action_dim: int,
        seed: int,
        num_threads: int | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._cancel = context.Event()
        self._proc = lifeline.tied_process(
            context,
            _serve,
            (child, self._cancel, config, tuple(obs_shape), int(action_dim), int(seed), num_threads),
            daemon=True,
        )
        self._proc.start()
        child.close()
        self.busy = False
        self._started = False
        self._timeout_s = timeout_s

    def _receive(self, timeout_s: float | None) -> Any:
        return receive_from(self._conn, self._proc, "the evaluation worker", timeout_s)

    def _ready(self) -> None:
        if not self._started:
            self._receive(self._timeout_s)  # the build's answer (a GL or task error surfaces here)
            self._started = True

    def submit(self, job: EvalJob) -> None:
        if self.busy:
            raise RuntimeError("EvalWorker.submit: a job is still in progress")
        self._ready()
        self._cancel.clear()
        self._conn.send(("evaluate", job))
        self.busy = True

    def poll(self) -> EvalResult | None:
        if not self.busy or not self._conn.poll():
            return None
        return self.wait()

    def wait(self) -> EvalResult:
        if not self.busy:
            raise RuntimeError("EvalWorker.wait: no job in progress")
        try:
            return self._receive(None)
        finally:
            self.busy = False

    def cancel(self) -> None:
        """Ask a job in progress to give up (it answers with ``returns=None``)."""
        if self.busy:
            self._cancel.set()

    def close(self) -> None:
        if self._proc.is_alive():
            if self.busy:
                self.cancel()
                try:
                    self.wait()
                except EnvWorkerError:
                    pass
            try:
                self._conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=5)
        self._conn.close()
