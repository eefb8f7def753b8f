"""Stopping a run on a signal without losing its work.

Runs end in other ways than by finishing: Ctrl-C (SIGINT), ``kill`` or a cluster's preemption
(SIGTERM), SLURM's warning some seconds before a time limit (``--signal=USR1@120``). The signals
named in ``stop.signals`` ask the run to stop; the handler only records the request
(:class:`StopRequest`, flags and a time -- nothing that allocates, blocks or raises), and the run
acts on it between updates (:class:`StopOnSignal`):

1. Before every agent step (seed steps included), and between the updates of a step that holds
   several (``train.updates_per_step`` above 1, or several environments), each rank contributes
   what it knows -- a signal, a second one, whether its environments are between episodes, how
   far the next boundary is, whether its wait ran out -- and one all-reduce of five integers
   makes the same decision on every rank. A signal seen by any one rank stops all of them at the
   same update, and no rank is ever left alone in a collective. (Over gloo: on NCCL runs it costs
   no GPU synchronisation.)
2. When the next episode boundary is at most ``stop.max_wait_steps`` env steps away, the run keeps
   training to it, for at most ``stop.max_wait_seconds`` after the signal: a checkpoint taken
   there resumes bit for bit, also between a step's updates (the updates left are kept due and
   a resume does them first). Otherwise it stops at once and the checkpoint is inexact (its
   collector state says ``at_episode_boundary: False``; a resume starts fresh episodes). Asked
   between updates too, the wait is bounded however many updates an agent step holds.
3. ``last.ckpt`` and its replay file are written (saving is collective; every rank writes its own
   replay file, rank 0 the checkpoint), Lightning ends ``fit`` normally -- loggers flushed, run
   summary written -- and the entry point prints one line and exits with code 75
   (``pixelsac.cli.EXIT_STOPPED``).

A second signal skips the wait and saves at once. A second signal while a checkpoint is being
written, or a third one, exits at once with code 128 + the signal's number (130 for Ctrl-C):
saves are atomic (temporary name, fsync, rename), so the checkpoint before stays loadable.
Once the run has ended -- saved and its exit code decided -- a command-line process keeps the
handlers to the end (``handle_stop_signals(..., linger=True)``): a signal during the teardown
that follows (loggers, worker processes, the interpreter's exit) is noted in one line and
changes nothing; 75 stays 75 (a third such signal exits at once with that same code).

Lightning's own SIGTERM handling is switched off for the run: in Lightning 2.6 it broadcasts from
rank 0 inside the signal handler -- a collective that hangs when another rank got the signal --
and raises SystemExit at the next batch, which would skip the save.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from pixelsac.config import stop_signal_names

_NO_BOUNDARY = 2**40  # steps to the boundary when no common boundary is in sight


def _say(line: str) -> None:
    """One line on stderr from a signal handler: ``os.write`` cannot re-enter a ``print`` that
    the handler interrupted."""
    with contextlib.suppress(OSError):
        os.write(2, f"pixelsac: {line}\n".encode())


class StopRequest:
    """What the signal handler records, and the stop's progress that the run writes back.

    Set by the handler: ``signal_name`` (the first stop signal), ``received_at``
    (``time.monotonic()`` then), ``count``, ``save_now`` (a second signal: stop waiting for the
    episode boundary). Set by the run: ``save_now`` too (an evaluation gave up on the signal and
    must be redone with the same weights, so the run stops right there), ``saving`` (a checkpoint
    is being written: a second signal now exits at once), ``stopped`` (training ended on the
    stop; what follows in ``fit`` -- the final evaluation -- is skipped) and
    ``gave_up_final_evaluation`` (the budget was done, the evaluation at its end was not).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self.count = 0
        self.save_now = False
        self.saving = False
        self.stopped = False
        self.gave_up_final_evaluation = False
        self.ended = False  # the run is over: later signals are noted and ignored (see linger)
        self.exit_code: int | None = None  # what the ended run exits with (set by the entry point)
        self._late = 0
        self.signals: list[signal.Signals] = []
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def pending(self) -> bool:
        """A stop signal arrived in this process."""
        return self.count > 0

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler (Python runs it in the main thread, between bytecodes)."""
        name = signal.Signals(signum).name
        if self.ended:
            self._late += 1
            if self._late >= 3 and self.exit_code is not None:  # a teardown that hangs still ends, same code
                _say(f"{name} a third time after the run ended: exiting now with code {self.exit_code}")
                os._exit(self.exit_code)
            _say(f"{name} after the run ended: ignored, the exit code stands (three times: exit at once)")
            return
        self.count += 1
        if self.count == 1:
            self.signal_name, self.received_at = name, time.monotonic()
            _say(
                f"{name}: stopping after the current update; saving last.ckpt, at the episode boundary if it "
                f"is near ({name} again: save at once)"
            )
        elif self.saving or self.count > 2:
            _say(
                f"{name} again: exiting now with code {128 + signum}, the checkpoint being written is abandoned; "
                "the previous one is intact"
            )
            os._exit(128 + signum)
        else:
            self.save_now = True
            _say(f"{name} again: saving at once, mid-episode ({name} once more exits without saving)")

    def install(self, names: list[str]) -> None:
        """Handle ``names`` from now on; the previous handlers are kept for :meth:`restore`.
        Python delivers signals to the main thread only: called from another thread (a run
        started inside some other program), this installs nothing and the defaults stay."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in names:
            signum = signal.Signals[name]
            if signum not in self._previous:
                self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self.handle)
            if signum not in self.signals:
                self.signals.append(signum)

    def ensure_installed(self) -> None:
        """Put the handler back where something else replaced it (a library installing its own)."""
        for signum in self.signals:
            if signal.getsignal(signum) != self.handle:
                signal.signal(signum, self.handle)

    def end(self) -> None:
        """The run's outcome is decided (fit returned): a stop signal from now on is noted and
        ignored, so one that lands right after the outcome line cannot turn a saved stop into an
        abandoned save."""
        self.ended = True

    def linger(self) -> None:
        """The run has ended: from now to the process's exit a stop signal is noted and ignored.
        At exit (the first ``atexit`` hook to run: registered last) the signals become ignored
        outright, because Python puts back the default handlers while it finalizes, and a signal
        in the C-level teardown after that (GL contexts, libraries) would kill the process."""
        self.end()
        atexit.register(self._ignore_to_the_end)

    def _ignore_to_the_end(self) -> None:
        for signum in self.signals:
            if signal.getsignal(signum) == self.handle:
                signal.signal(signum, signal.SIG_IGN)

    def restore(self) -> None:
        """The handlers from before :meth:`install`."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous, self.signals = {}, []


@contextlib.contextmanager
def handle_stop_signals(signals: str | None, linger: bool = False) -> Iterator[StopRequest]:
    """Catch ``stop.signals`` (a comma-separated string, or None for the OS defaults) for the
    duration of the block; yields the :class:`StopRequest` they fill in. With ``linger`` (a
    process whose exit follows, e.g. the command line) the handlers stay after the block and
    ignore what arrives: the run's outcome and exit code are decided."""
    request = StopRequest()
    request.install(stop_signal_names(signals))
    try:
        yield request
    finally:
        if linger:
            request.linger()
        else:
            request.restore()


@dataclass(frozen=True)
class StopOutcome:
    """How a stopped run ended, for the one line the entry point prints."""

    signal_name: str
    env_frames: int  # over all ranks
    updates: int
    checkpoint: Path | None  # the last.ckpt holding this stop's state; None when nothing was written
    exact: bool  # taken at an episode boundary: the resume continues bit for bit
    reason: str  # "saved" | "already saved" | "nothing new" | "non-finite weights" | "final evaluation"
    previous: Path | None = None  # the checkpoint that stands when this stop wrote none

    def message(self, run_dir: Path) -> str:
        """The line printed at the end (rank 0)."""
        where = f"after update {self.updates} at env frame {self.env_frames}"
        resume = f"continue with: pixelsac-train resume={run_dir} (or this command with resume=auto)"
        previous = self.previous
        if self.reason == "final evaluation":
            return (
                f"stopped by {self.signal_name} during the final evaluation {where}: saved {self.checkpoint} "
                f"with its replay; {resume} -- it runs that evaluation"
            )
        if self.reason in ("saved", "already saved"):
            how = (
                "exact: at an episode boundary"
                if self.exact
                else "inexact: mid-episode, the resumed run starts new episodes"
            )
            return f"stopped by {self.signal_name} {where}: saved {self.checkpoint} with its replay ({how}); {resume}"
        if self.reason == "nothing new":
            stands = f"{previous} stands" if previous else "there is no checkpoint yet"
            return (
                f"stopped by {self.signal_name} {where}, before any new work: nothing to save ({stands}); "
                f"run the same command again to go on"
            )
        stands = f"last good checkpoint: {previous}" if previous else "no checkpoint was written"
        return f"stopped by {self.signal_name} {where}, but the weights are not finite: nothing saved ({stands})"


def keep_lightning_off_signals(trainer: L.Trainer) -> None:
    """Stop Lightning from installing its SIGTERM (and SLURM SIGUSR1 requeue) handlers in ``fit``:
    see the module docstring. Uses a private attribute; without it (another Lightning) nothing
    changes and :meth:`StopOnSignal.on_train_start` still puts our handler back."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None and hasattr(connector, "register_signal_handlers"):
        connector.register_signal_handlers = lambda: None


class StopOnSignal(L.Callback):
    """Turns a :class:`StopRequest` into a stop at a safe point, a checkpoint and an outcome.

    ``stream`` is the :class:`~pixelsac.collect.ExperienceStream` (asked before each agent step
    through its ``stop_check``), ``collector`` its collector, ``checkpointer`` the run's
    :class:`~pixelsac.callbacks.Checkpointer` (``request``, ``save_pending``, ``saved_at``,
    ``stopped_by``, ``last_path``). After ``fit``, :attr:`outcome` says what happened (None: the
    run was not stopped by a signal).
    """

    def __init__(
        self,
        request: StopRequest,
        stream: Any,
        collector: Any,
        checkpointer: Any,
        max_wait_steps: int,
        max_wait_seconds: float,
    ) -> None:
        self.request, self.stream, self.collector, self.checkpointer = request, stream, collector, checkpointer
        self.max_wait_steps, self.max_wait_seconds = int(max_wait_steps), float(max_wait_seconds)
        self.outcome: StopOutcome | None = None
        self._world = 1
        self._group: Any = None  # the process group of the decision's all-reduce (None: the default one)
        self._wait_until: int | None = None  # agent steps: stop here at the latest (set at the first decision)
        self._exact = False
        self._start: tuple[int, int] = (0, 0)  # (agent steps, updates) when training started

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        keep_lightning_off_signals(trainer)
        self._world = trainer.world_size
        if self._world > 1 and dist.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # collective: every rank is in setup
        if self.request.signals:  # the same stop.signals on every rank: all ask, or none does
            self.stream.stop_check = self.decide

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.request.ensure_installed()
        self._start = (self.collector.agent_steps, pl_module.updates)

    def decide(self) -> bool:
        """Stop here (before the next agent step, or the next update of this one)? The same
        answer on every rank."""
        request, collector = self.request, self.collector
        if self._world == 1 and not request.pending:
            return False
        waited_out = request.received_at is not None and time.monotonic() - request.received_at >= self.max_wait_seconds
        to_boundary = collector.steps_to_episode_boundary
        votes = torch.tensor(
            [
                int(request.pending),
                int(request.save_now),
                int(not collector.at_episode_boundary),
                _NO_BOUNDARY if to_boundary is None else to_boundary,
                int(waited_out),
            ],
            dtype=torch.int64,
        )
        if self._world > 1:
            dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self._group)
        pending, save_now, mid_episode, to_boundary, waited_out = (int(v) for v in votes.tolist())
        if not pending:
            return False
        if self._wait_until is None:  # the first decision after the signal: wait for the boundary or not
            wait = to_boundary if to_boundary <= self.max_wait_steps else 0
            self._wait_until = collector.agent_steps + wait * collector.num_envs
        self._exact = not mid_episode
        return not mid_episode or bool(save_now) or bool(waited_out) or collector.agent_steps >= self._wait_until

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if not self.stream.stopped_early or self.outcome is not None:
            return
        trainer.should_stop = True
        self.request.stopped = True
        self.outcome = self._save(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        """The budget was done, but the signal gave up its final evaluation (the Evaluator, before
        this callback, still saved): the run is not finished."""
        if self.outcome is None and self.request.gave_up_final_evaluation:
            self.outcome = StopOutcome(
                self.request.signal_name or "a signal",
                self.collector.total_env_frames,
                pl_module.updates,
                self.checkpointer.last_path,
                self.collector.at_episode_boundary,
                "final evaluation",
            )

    def _save(self, trainer: L.Trainer, module: Any) -> StopOutcome:
        collector, checkpointer = self.collector, self.checkpointer
        now = (collector.agent_steps, module.updates)
        last = checkpointer.last_path
        outcome = dict(
            signal_name=self.request.signal_name or "a signal to another rank",
            env_frames=collector.total_env_frames,
            updates=module.updates,
            exact=self._exact,
            checkpoint=None,
            previous=last if last.is_file() else None,
        )
        if now == self._start:
            return StopOutcome(**outcome, reason="nothing new")
        if checkpointer.saved_at == now:  # e.g. the signal came while an evaluation's checkpoint was written
            return StopOutcome(**{**outcome, "checkpoint": checkpointer.last_path}, reason="already saved")
        if not module.weights_are_finite():  # identical on every rank: all skip the collective save together
            return StopOutcome(**outcome, reason="non-finite weights")
        checkpointer.stopped_by = outcome["signal_name"]
        checkpointer.request(best=False)
        checkpointer.save_pending(trainer, module)  # the Checkpointer marks the request as saving meanwhile
        return StopOutcome(**{**outcome, "checkpoint": checkpointer.last_path}, reason="saved")
