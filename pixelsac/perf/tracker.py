"""The run's performance callback: throughput, time and memory per update against fp32.

:class:`PerfTracker` logs throughput, ms and peak memory per update and state bytes every log
interval (step = env frames), against an fp32 copy of the agent calibrated at
start-up (:mod:`pixelsac.perf.calibration`), and writes the end-of-run summary
(:mod:`pixelsac.perf.summary`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

import lightning as L
import torch

from pixelsac.graphs import update_cycle
from pixelsac.logs import log_metrics
from pixelsac.lowp import reset_split_k_paths
from pixelsac.perf import meters
from pixelsac.perf.calibration import (
    Fp32Reference,
    batch_source_of,
    fp32_reference_config,
    place_batch,
    synthetic_batch,
    time_updates,
)
from pixelsac.perf.meters import (
    MIB,
    HostLoadMeter,
    PeakMemory,
    SavedBytes,
    SavedTensorMeter,
    UpdateTimer,
    _fmt_bytes,
    module_state_tensors,
    ratio,
    speedup,
    state_groups,
)
from pixelsac.perf.summary import build_summary, format_summary, write_summary
from pixelsac.precision import state_bytes


def _optimizers_have_state(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Optimizer state is created at the first step actually taken (a skipped step creates none);
    state bytes are reported once it exists for every parameter."""
    return all(opt.state.get(p) for opt in optimizers for group in opt.param_groups for p in group["params"])


class PerfTracker(UpdateTimer):
    """Logs throughput, ms and peak memory per update and state bytes (loss scales and skipped
    steps are the TrainingLogger's) every ``train.log_every_updates`` updates (step = env
    frames), against an fp32 copy of the agent timed at start-up (``perf.calibrate_updates``
    after ``perf.warmup_updates``), and writes the end-of-run summary (printed table,
    ``summary.json``, ``summary.md`` in ``run_dir``).

    ``collector`` supplies the counters (``total_env_frames``/``total_agent_steps`` over all ranks,
    or ``env_frames``/``agent_steps``; ``replay`` if it has one).
    Put it first in the Trainer's callbacks (see :class:`UpdateTimer`).

    The speed-up it reports is a start-up estimate and says so: no speed-up for an fp32 run (its
    reference is itself: it is not calibrated), none when ``perf.shared_device`` says other runs
    share the device, and the estimate is marked unreliable when other processes kept the host
    busy while it was timed. The reference is saved in the checkpoint (:meth:`state_dict`) and
    reused on resume rather than timed again.
    """

    def __init__(self, collector: Any, run_dir: str | Path, cfg: Any) -> None:
        super().__init__()
        self.collector = collector
        self.run_dir = Path(run_dir)
        self.log_every = int(cfg.train.log_every_updates)
        self.calibrate_updates = int(cfg.perf.calibrate_updates)
        self.warmup_updates = int(cfg.perf.warmup_updates)
        self.batch_size = int(cfg.agent.batch_size)
        self.seed = int(cfg.seed)
        self.peak: PeakMemory | None = None
        self.fp32: Fp32Reference | None = None
        self.summary: dict[str, Any] | None = None
        self._fit_start: float | None = None
        self.actor_every = int(cfg.agent.actor_update_every)
        cycle = update_cycle(self.actor_every, int(cfg.agent.critic_target_update_every))
        # the run's own first updates warm up like calibration's, in whole update cycles
        self._to_discard = -(-self.warmup_updates // cycle) * cycle
        self.shared_device = bool(cfg.perf.get("shared_device", False))
        self.fp32_is_self = False  # the run is the fp32 reference itself: no speed-up to report
        self.fp32_restored = False  # the reference came from the checkpoint, not timed again
        self._ms_all: list[float] = []
        self._peak_max: int | None = None
        self._state: dict[str, int] | None = None
        self._groups: dict[str, dict[str, int]] | None = None
        self.saved: SavedBytes | None = None  # what the first full update of the fit saved for backward
        self._meter: SavedTensorMeter | None = None
        self._last_logged = -1

    # --- start-up ---------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.peak = PeakMemory(trainer.strategy.root_device)

    def calibrate(self, module: Any, device: torch.device) -> Fp32Reference:
        """Time ``calibrate_updates`` updates of an fp32 copy of ``module``'s agent, on a batch
        where the run's replay puts its batches (pinned host memory, or on the device): a
        pageable batch would charge the fp32 reference a synchronous copy the run does not pay."""
        start = meters._now()
        source = batch_source_of(getattr(self.collector, "replay", None), device)
        batch = place_batch(
            synthetic_batch(self.batch_size, module.obs_shape, module.action_dim, seed=self.seed), source, device
        )
        with HostLoadMeter() as load:
            timed = time_updates(
                fp32_reference_config(module.hparams["config"]),
                module.obs_shape,
                module.action_dim,
                batch,
                device,
                self.calibrate_updates,
                self.warmup_updates,
            )
        host = load.result
        return Fp32Reference(
            timed.mean_ms,
            timed.std_ms,
            len(timed.ms),
            timed.warmup,
            timed.state,
            timed.peak_bytes,
            meters._now() - start,
            dataclasses.asdict(timed.saved) if timed.saved is not None else None,
            timed.state_groups,
            host_other_cores=host.other_cores,
            host_busy=host.busy,
            host_load=host.describe(),
            cuda_graphs=timed.graph_setup_updates > 0,
            graph_setup_updates=timed.graph_setup_updates,
            batch_source=source,
        )

    # --- the reference travels with the checkpoint ----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The fp32 reference as plain data (a resumed run reuses it instead of timing again)."""
        return {
            "fp32": dataclasses.asdict(self.fp32) if self.fp32 is not None else None,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("fp32")
        if saved and state_dict.get("batch_size") == self.batch_size:  # another batch size: time it again
            known = {field.name for field in dataclasses.fields(Fp32Reference)}
            self.fp32 = Fp32Reference(**{k: v for k, v in saved.items() if k in known})
            self.fp32_restored = True

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        device = trainer.strategy.root_device
        frames = self._env_frames()
        policy = pl_module.precision_policy
        self.fp32_is_self = policy.mode == "fp32" and not policy.tf32
        if self.fp32_restored and trainer.is_global_zero:
            print(f"perf: fp32 reference from the checkpoint, not timed again: {self.fp32.describe()}")
        elif self.fp32_is_self and self.calibrate_updates > 0 and trainer.is_global_zero:
            print("perf: this run is fp32, the reference itself: no fp32 calibration, no speed-up figure")
        elif self.calibrate_updates > 0 and trainer.is_global_zero:
            self.fp32 = self.calibrate(pl_module, device)
            row = {
                "perf/fp32_ms_per_update": self.fp32.ms_per_update,
                "perf/fp32_state_bytes": self.fp32.state["total"],
            }
            if self.fp32.peak_bytes is not None:
                row["perf/fp32_peak_cuda_allocated_mib"] = self.fp32.peak_bytes / MIB
            if self.fp32.saved is not None:
                row["perf/fp32_saved_for_backward_bytes"] = self.fp32.saved["activations"]
            log_metrics(trainer, {**row, **self._counters(pl_module)}, step=frames)
            print(
                f"perf: fp32 reference {self.fp32.ms_per_update:.1f} ms/update (batch {self.batch_size}, "
                f"{self.fp32.describe()}, {self.fp32.seconds:.1f} s), state {_fmt_bytes(self.fp32.state['total'])}"
            )
        if trainer.is_global_zero:
            print(f"perf: peak memory = {self.peak.describe()}")
        self._fit_start = self._interval_start = meters._now()
        self._fit_frames = self._interval_frames = frames
        self._fit_agent_steps = self._agent_steps()
        self._fit_updates = self._interval_updates = pl_module.updates
        self.peak.reset()
        reset_split_k_paths()  # the summary's split-K path: this run's products, as its peak

    # --- every update -----------------------------------------------------------------------
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # One update is metered, the first that runs the actor and the temperature too; the
        # hooks cost a Python call per saved tensor, so not every update.
        if self.saved is None and self._meter is None and pl_module.updates % self.actor_every == 0:
            self._meter = SavedTensorMeter(module_state_tensors(pl_module)).__enter__()

    def _close_meter(self, keep: bool) -> None:
        if self._meter is not None:
            meter, self._meter = self._meter, None
            meter.__exit__(None, None, None)
            if keep:
                self.saved = meter.result()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._close_meter(keep=self.updated(pl_module))  # a step that updated nothing is metered again
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if pl_module.updates % self.log_every == 0 and pl_module.updates != self._last_logged:
            self._last_logged = pl_module.updates
            log_metrics(
                trainer,
                {**self.interval_metrics(trainer, pl_module), **self._counters(pl_module)},
                step=self._env_frames(),
            )

    def _env_frames(self) -> int:
        """Env frames over all data-parallel ranks (what every log's step counts)."""
        return int(getattr(self.collector, "total_env_frames", self.collector.env_frames))

    def _agent_steps(self) -> int:
        return int(getattr(self.collector, "total_agent_steps", self.collector.agent_steps))

    def _counters(self, module: Any) -> dict[str, float]:
        return {"env_frames": self._env_frames(), "agent_steps": self._agent_steps(), "updates": module.updates}

    def _compares_speed(self) -> bool:
        """A speed-up means something: a reference that is not the run itself, a device alone."""
        return self.fp32 is not None and not self.fp32_is_self and not self.shared_device

    def _replay_device_bytes(self) -> int:
        """Bytes of a replay buffer held on the GPU: in the run's peak, never in the fp32 copy's."""
        replay = getattr(self.collector, "replay", None)
        device = getattr(replay, "device", None)
        return int(getattr(replay, "nbytes", 0)) if device is not None and torch.device(device).type == "cuda" else 0

    def _drain(self) -> list[float]:
        ms = self.clock.drain()
        dropped = min(self._to_discard, len(ms))
        self._to_discard -= dropped
        ms = ms[dropped:]
        self._ms_all.extend(ms)
        return ms

    def _read_peak(self) -> int:
        peak = self.peak.read()
        self._peak_max = peak if self._peak_max is None else max(self._peak_max, peak)
        self.peak.reset()
        return peak

    def interval_metrics(self, trainer: L.Trainer, module: Any) -> dict[str, float]:
        """The figures of the interval since the last call (one device sync on a GPU)."""
        now = meters._now()
        seconds = max(now - self._interval_start, 1e-9)
        ms = self._drain()
        row: dict[str, float] = {
            "perf/env_frames_per_s": (self._env_frames() - self._interval_frames) / seconds,
            "perf/updates_per_s": (module.updates - self._interval_updates) / seconds,
        }
        self._interval_start, self._interval_frames, self._interval_updates = now, self._env_frames(), module.updates
        peak = self._read_peak()
        row[self.peak.metric] = peak / MIB
        if ms:
            row["perf/ms_per_update"] = statistics.fmean(ms)
            faster = speedup(self.fp32.ms_per_update, row["perf/ms_per_update"]) if self._compares_speed() else None
            if faster is not None:
                row["perf/speedup_vs_fp32"] = faster
        if _optimizers_have_state(trainer.optimizers):
            self._state = state_bytes(module, trainer.optimizers)
            self._groups = state_groups(module, trainer.optimizers)
            row.update({f"perf/state_bytes_{k}": v for k, v in self._state.items() if k != "total"})
            row.update(
                {
                    f"perf/state_bytes_{kind}/{name}": v
                    for kind, members in self._groups.items()
                    for name, v in members.items()
                }
            )
            row["perf/state_bytes"] = self._state["total"]
            if self.fp32 is not None:
                row["perf/memory_vs_fp32"] = ratio(self._state["total"], self.fp32.state["total"])
        if self.saved is not None:
            row["perf/saved_for_backward_bytes"] = self.saved.activations
            if self.fp32 is not None and self.fp32.saved is not None:
                row["perf/saved_for_backward_vs_fp32"] = ratio(self.saved.activations, self.fp32.saved["activations"])
        graphs = getattr(module, "update_graphs", None) is not None
        if self.fp32 is not None and self.fp32.peak_bytes is not None and self.peak.kind == "cuda_max_allocated":
            if not graphs:  # an interval of replays allocates nothing: its peak leaves the graphs' pool out
                row["perf/peak_memory_vs_fp32"] = ratio(peak - self._replay_device_bytes(), self.fp32.peak_bytes)
        # loss scales and skipped steps: the TrainingLogger's, at the same interval
        return row

    # --- the end ----------------------------------------------------------------------------
    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        # on_fit_end, not on_train_end: the Evaluator's final evaluation runs in on_train_end
        self.finish(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        # a run stopped early (non-finite weights, Ctrl-C) still says what it cost until then
        self._close_meter(keep=False)
        if self._fit_start is not None and self.summary is None:
            self.finish(trainer, pl_module, stopped_by=f"{type(exception).__name__}: {exception}")

    def finish(self, trainer: L.Trainer, pl_module: Any, stopped_by: str | None = None) -> None:
        """Drain the last interval, then print and write the summary (global rank zero)."""
        self._drain()
        self._read_peak()
        if _optimizers_have_state(trainer.optimizers):
            self._state = state_bytes(pl_module, trainer.optimizers)
            self._groups = state_groups(pl_module, trainer.optimizers)
        if not trainer.is_global_zero:
            return
        evaluator = next((c for c in trainer.callbacks if type(c).__name__ == "Evaluator"), None)
        best = getattr(evaluator, "best_return", None)
        replay = getattr(self.collector, "replay", None)
        self.summary = build_summary(
            precision=pl_module.precision_policy.describe(),
            device=str(trainer.strategy.root_device),
            batch_size=self.batch_size,
            env_frames=self._env_frames() - self._fit_frames,
            agent_steps=self._agent_steps() - self._fit_agent_steps,
            updates=pl_module.updates - self._fit_updates,
            wall_s=meters._now() - self._fit_start,
            ms=self._ms_all,
            peak_bytes=self._peak_max,
            peak_kind=self.peak.kind,
            state=self._state,
            loss_scales=pl_module.loss_scales(),
            skipped=dict(pl_module.skipped),
            best_eval_return=best if best is not None and math.isfinite(best) else None,
            fp32=self.fp32,
            replay_bytes=getattr(replay, "nbytes", None),
            replay_bytes_per_transition=getattr(replay, "bytes_per_transition", None),
            stopped_by=stopped_by,
            saved=self.saved,
            state_groups=self._groups,
            fp32_is_self=self.fp32_is_self,
            shared_device=self.shared_device,
            fp32_restored=self.fp32_restored,
            replay_device_bytes=self._replay_device_bytes(),
        )
        write_summary(self.run_dir, self.summary)
        print(format_summary(self.summary))
