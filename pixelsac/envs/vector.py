"""Several environments stepped together: in this process (:class:`SerialEnvs`) or each in its
own worker process (:class:`ParallelEnvs`, ``env.num_envs=N``).

On a CPU, rendering is the whole cost of pixel collection (~15-30 ms a frame against ~0.1 ms a
physics step), so N worker processes render N frames in the time of one while the learner asks
for one batched policy forward pass per step. Environment ``i`` is seeded ``seeds[i]`` in both
flavours, and a worker does exactly what the in-process environment would: the same seeds and
actions give the same transitions. A worker that raises reports its error and traceback; one
that dies outright (killed, crashed) is reported with its exit code -- never waited on forever.
A worker ends with the process that started it, however that ends (:mod:`pixelsac.lifeline`).

A step can also be split in two, :meth:`step_async` (hand out the actions) and :meth:`step_wait`
(take the transitions), so that the learner updates while the environments step
(``train.overlap_collection``): workers run the step during the update (a run that overlaps
always steps its environments in workers); in this process nothing runs beside the caller, so
:meth:`SerialEnvs.step_wait` takes the step then. While a step is in flight nothing else may be
asked of the set but :meth:`step_wait` and :meth:`close`.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pixelsac import lifeline
from pixelsac.envs.dmc import DMCEnv, EnvError, TimeStep

#: what every env of a set has alike (asked of the first, or reported once by each worker)
SHARED_ATTRIBUTES = (
    "obs_shape",
    "frame_shape",
    "frame_dtype",
    "action_dim",
    "action_repeat",
    "frame_stack",
    "episode_frames",
)


class EnvWorkerError(RuntimeError):
    """An environment worker process failed; the message carries its error."""


def _refuse_in_flight(in_flight: bool, what: str) -> None:
    if in_flight:
        raise RuntimeError(f"{what}() while a step is in flight: take it with step_wait() first")


class SerialEnvs:
    """N environments in this process, with the same interface as :class:`ParallelEnvs`."""

    def __init__(self, task: str, seeds: Sequence[int], **env_kwargs: Any) -> None:
        self.envs = [DMCEnv(task, seed=seed, **env_kwargs) for seed in seeds]
        self.seeds = list(seeds)
        self._actions: np.ndarray | None = None  # a step handed out, not yet taken (step_async)

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    def __getattr__(self, name: str) -> Any:
        # shapes, dtypes, action repeat... are the same for every env: ask the first
        if name in (*SHARED_ATTRIBUTES, "task"):
            return getattr(self.envs[0], name)
        raise AttributeError(name)

    def reset(self, indices: Sequence[int]) -> list[TimeStep]:
        _refuse_in_flight(self.in_flight, "reset")
        return [self.envs[i].reset() for i in indices]

    def step(self, actions: np.ndarray) -> list[TimeStep]:
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: np.ndarray) -> None:
        """Hand out one action per environment; :meth:`step_wait` steps them (in this process
        nothing can run beside the learner, so the step waits for the caller's next call)."""
        _refuse_in_flight(self.in_flight, "step_async")
        self._actions = np.asarray(actions)

    def step_wait(self) -> list[TimeStep]:
        """Step every environment with the actions of :meth:`step_async`."""
        if self._actions is None:
            raise RuntimeError("step_wait() without a step_async()")
        actions, self._actions = self._actions, None
        return [env.step(action) for env, action in zip(self.envs, actions)]

    @property
    def in_flight(self) -> bool:
        """A step has been handed out and not yet taken."""
        return self._actions is not None

    def get_rng_states(self) -> list[dict]:
        _refuse_in_flight(self.in_flight, "get_rng_states")
        return [env.get_rng_state() for env in self.envs]

    def set_rng_states(self, states: Sequence[dict]) -> None:
        _refuse_in_flight(self.in_flight, "set_rng_states")
        for env, state in zip(self.envs, states):
            env.set_rng_state(state)

    def close(self) -> None:
        self._actions = None  # a step handed out and never taken is dropped
        for env in self.envs:
            env.close()


#: Signals a worker ignores: they ask the run to stop, and the parent decides how (Ctrl-C reaches
#: the terminal's whole process group, SLURM signals every process of a job step). A worker ends
#: when the parent closes it, and is killed when the parent ends (:mod:`pixelsac.lifeline`).
PARENTS_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")


def ignore_parents_signals() -> None:
    """In a worker process: leave the stop signals to the parent (see :data:`PARENTS_SIGNALS`)."""
    for name in PARENTS_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def receive_from(conn: Connection, proc: Any, who: str, timeout_s: float | None) -> Any:
    """A worker's ``("ok", payload)`` answer's payload; an answer that does not come because the
    worker died or took longer than ``timeout_s`` (None: no limit), or an ``("error", ...)``
    answer, is an :class:`EnvWorkerError` naming ``who`` (an :class:`EnvError` stays one)."""
    waited = 0.0
    while not conn.poll(1.0):
        waited += 1.0
        if not proc.is_alive():
            raise EnvWorkerError(f"{who} died with exit code {proc.exitcode} without answering")
        if timeout_s is not None and waited >= timeout_s:
            raise EnvWorkerError(f"{who} did not answer within {timeout_s:.0f} s")
    try:
        status, payload = conn.recv()
    except EOFError:
        proc.join(timeout=5)
        raise EnvWorkerError(f"{who} died with exit code {proc.exitcode}") from None
    if status == "error":
        kind, message, trace = payload
        if kind == "EnvError":
            raise EnvError(message)
        raise EnvWorkerError(f"{who} failed: {kind}: {message}\n{trace}")
    return payload


def _worker(conn: Connection, task: str, seed: int, env_kwargs: dict) -> None:
    """Serve one DMCEnv over a pipe until told to close; every failure goes back as a message."""
    ignore_parents_signals()
    try:
        env = DMCEnv(task, seed=seed, **env_kwargs)
        conn.send(
            (
                "ok",
                {name: getattr(env, name) for name in SHARED_ATTRIBUTES},
            )
        )
    except BaseException as exc:  # noqa: BLE001 -- report anything, including EnvError
        conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    try:
        while True:
            command, arg = conn.recv()
            try:
                if command == "reset":
                    result: Any = env.reset()
                elif command == "step":
                    result = env.step(arg)
                elif command == "get_rng":
                    result = env.get_rng_state()
                elif command == "set_rng":
                    result = env.set_rng_state(arg)
                elif command == "close":
                    env.close()
                    conn.send(("ok", None))
                    return
                else:
                    raise ValueError(f"unknown command {command!r}")
                conn.send(("ok", result))
            except BaseException as exc:  # noqa: BLE001
                conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the parent went away: nothing left to serve


class ParallelEnvs:
    """N environments, each in a worker process started with ``spawn`` (a fresh interpreter:
    forking a process that holds OpenGL contexts is not safe) and tied to this process: the
    kernel kills it when this process ends, even by SIGKILL (:func:`pixelsac.lifeline.tied_process`)."""

    def __init__(self, task: str, seeds: Sequence[int], timeout_s: float = 300.0, **env_kwargs: Any) -> None:
        self.seeds, self.task_name, self.timeout_s = list(seeds), task, timeout_s
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._in_flight = False  # every worker has been sent a step whose answer is not yet taken
        for seed in self.seeds:
            parent, child = context.Pipe()
            proc = lifeline.tied_process(context, _worker, (child, task, seed, env_kwargs), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            infos = [self._receive(i) for i in range(len(self.seeds))]
        except BaseException:
            self.close()
            raise
        self._info = infos[0]

    @property
    def num_envs(self) -> int:
        return len(self._conns)

    def __getattr__(self, name: str) -> Any:
        info = self.__dict__.get("_info", {})
        if name in info:
            return info[name]
        if name == "task":
            return self.task_name
        raise AttributeError(name)

    def _receive(self, i: int) -> Any:
        who = f"env worker {i} ({self.task_name}, seed {self.seeds[i]})"
        return receive_from(self._conns[i], self._procs[i], who, self.timeout_s)

    def _call_all(self, command: str, args: Sequence[Any], indices: Sequence[int]) -> list[Any]:
        self._send_all(command, args, indices)
        return [self._receive(i) for i in indices]  # all requests first: the workers run in parallel

    def _send_all(self, command: str, args: Sequence[Any], indices: Sequence[int]) -> None:
        _refuse_in_flight(self._in_flight, command)
        for i, arg in zip(indices, args):
            try:
                self._conns[i].send((command, arg))
            except (BrokenPipeError, EOFError, OSError):
                self._procs[i].join(timeout=5)
                raise EnvWorkerError(
                    f"env worker {i} ({self.task_name}, seed {self.seeds[i]}) died "
                    f"with exit code {self._procs[i].exitcode}"
                ) from None

    def reset(self, indices: Sequence[int]) -> list[TimeStep]:
        return self._call_all("reset", [None] * len(indices), indices)

    def step(self, actions: np.ndarray) -> list[TimeStep]:
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: np.ndarray) -> None:
        """Send every worker its action and return at once: the workers step while the caller
        goes on; :meth:`step_wait` takes the transitions."""
        self._send_all("step", list(actions), range(self.num_envs))
        self._in_flight = True

    def step_wait(self) -> list[TimeStep]:
        """The transitions of the step :meth:`step_async` handed out, waited for."""
        if not self._in_flight:
            raise RuntimeError("step_wait() without a step_async()")
        self._in_flight = False  # taken or failed: a worker that failed has answered or died
        return [self._receive(i) for i in range(self.num_envs)]

    @property
    def in_flight(self) -> bool:
        """A step has been sent to the workers and its answers not yet taken."""
        return self._in_flight

    def get_rng_states(self) -> list[dict]:
        return self._call_all("get_rng", [None] * self.num_envs, range(self.num_envs))

    def set_rng_states(self, states: Sequence[dict]) -> None:
        self._call_all("set_rng", list(states), range(self.num_envs))

    def close(self) -> None:
        in_flight, self._in_flight = self._in_flight, False
        for conn, proc in zip(self._conns, self._procs):
            try:
                if in_flight and proc.is_alive() and conn.poll(10):
                    conn.recv()  # the answer to a step never taken (the run ended during an update)
                if proc.is_alive():
                    conn.send(("close", None))
                    if conn.poll(10):
                        conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
            conn.close()
        self._conns, self._procs = [], []


def make_envs(task: str, seeds: Sequence[int], parallel: bool, **env_kwargs: Any) -> SerialEnvs | ParallelEnvs:
    """``len(seeds)`` environments, in worker processes when ``parallel``."""
    return ParallelEnvs(task, seeds, **env_kwargs) if parallel else SerialEnvs(task, seeds, **env_kwargs)
