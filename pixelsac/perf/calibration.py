"""The fp32 calibration harness: time the real update step of a fresh agent on one batch.

:func:`time_updates` runs ``SACModule.training_step`` on one synthetic batch under a throwaway
Trainer, the batch placed as the run's or the benchmark cell's (:func:`place_batch`). The
start-up fp32 calibration of a run (:class:`pixelsac.perf.tracker.PerfTracker`) and
``python -m pixelsac.bench`` both use it.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import statistics
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from pixelsac.cli import quiet_lightning
from pixelsac.config import SIX
from pixelsac.graphs import update_cycle, updates_to_capture
from pixelsac.module import SACModule
from pixelsac.perf.meters import (
    PeakMemory,
    SavedBytes,
    SavedTensorMeter,
    TensorPeakMeter,
    UpdateTimer,
    module_state_tensors,
    parameters_finite,
    state_groups,
)
from pixelsac.precision import state_bytes

_NEVER = 2**62  # a log interval no measured run reaches


@dataclasses.dataclass
class TimedUpdates:
    """What :func:`time_updates` measured."""

    ms: list[float]  # each timed update (after the warm-up), milliseconds
    state: dict[str, int]  # precision.state_bytes: parameters, optimizer, target, total
    peak_bytes: int | None  # GPU: peak allocated over the timed updates above what was
    # allocated before the module was built (with CUDA graphs: from before the first
    # update, so the graphs' capture into their pool counts); None on a CPU
    finite_after_first: bool  # parameters finite after the very first update
    finite_at_end: bool
    skipped: dict[str, int]  # skipped optimizer steps per loss, warm-up included
    loss_scales: dict[str, float]
    saved: SavedBytes | None = None  # saved for backward in the first (full) update
    state_groups: dict[str, dict[str, int]] | None = None  # state_groups(): by kind and group
    ms_by_form: dict[str, list[float]] | None = None  # interleaved emulation forms, timed
    tensor_peak_bytes: int | None = None  # TensorPeakMeter over the first update (CPU)
    warmup: int = 0  # untimed updates before the timed ones (whole update cycles)
    graph_setup_updates: int = 0  # CUDA graphs' eager warm-ups and captures (untimed, before warmup)
    graph_pool_bytes: int | None = None  # what the graphs' private pool holds at the end

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.ms) if self.ms else math.nan

    @property
    def std_ms(self) -> float:
        return statistics.pstdev(self.ms) if len(self.ms) > 1 else 0.0


EMULATION_FORMS = {True: "saves_low", False: "saves_fp32"}


class _EmulationFormPolicy:
    """A module's precision policy with the CPU emulation's form chosen from outside: what
    ``lowp.fp32_accumulate`` saves for backward (``save_low_precision``; the values are the same
    either way). Everything but :meth:`compute_context` is the policy's own."""

    def __init__(self, policy: Any, save_low_precision: bool) -> None:
        self._policy = policy
        self.save_low_precision = save_low_precision

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def compute_context(self) -> Any:
        return self._policy.compute_context(self.save_low_precision)


def interleaved_forms(warmup: int, updates: int) -> list[bool]:
    """``save_low_precision`` for each update when two emulation forms are timed in one run:
    alternating through the warm-up, then A B B A from the first timed update on, so that each
    form gets as many even as odd updates (DrQ runs the actor on every other update)."""
    return [i % 2 == 0 for i in range(warmup)] + [(i % 4) in (0, 3) for i in range(updates)]


class _Probe(UpdateTimer):
    """UpdateTimer that also resets the peak-memory counter before the first timed update, checks
    the parameters after the first update (outside the timed span), meters what the first update
    saves for backward, and (``forms``) sets the emulation's form before each update."""

    def __init__(
        self,
        warmup: int,
        forms: list[bool] | None = None,
        tensor_peak: bool = False,
        reset_peak_at: int | None = None,
        meter_saved: bool = True,
    ) -> None:
        super().__init__()
        self.meter_saved = meter_saved
        self.warmup = warmup
        self.reset_peak_at = warmup if reset_peak_at is None else reset_peak_at
        self.started = 0
        self.peak: PeakMemory | None = None
        self.finite_after_first: bool | None = None
        self.forms = forms
        self.saved: SavedBytes | None = None
        self.tensor_peak = tensor_peak
        self.tensor_peak_bytes: int | None = None
        self._meter: SavedTensorMeter | None = None
        self._peak_meter: TensorPeakMeter | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.strategy.root_device.type == "cuda":
            self.peak = PeakMemory(trainer.strategy.root_device)

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.forms is not None:  # after the module's setup, which builds its policy
            pl_module.precision_policy = _EmulationFormPolicy(pl_module.precision_policy, self.forms[0])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.started == self.reset_peak_at and self.peak is not None:
            self.peak.reset()
        if self.forms is not None:
            pl_module.precision_policy.save_low_precision = self.forms[min(self.started, len(self.forms) - 1)]
        if self.started == 0 and self.meter_saved:  # update 0 runs the critic, the actor and the temperature
            self._meter = SavedTensorMeter(module_state_tensors(pl_module)).__enter__()
            if self.tensor_peak:
                self._peak_meter = TensorPeakMeter().__enter__()
        self.started += 1
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def _close_meters(self) -> None:
        if self._peak_meter is not None:
            peak_meter, self._peak_meter = self._peak_meter, None
            peak_meter.__exit__(None, None, None)
            self.tensor_peak_bytes = peak_meter.peak
        if self._meter is not None:
            meter, self._meter = self._meter, None
            meter.__exit__(None, None, None)
            self.saved = meter.result()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._close_meters()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.finite_after_first is None and self.updated(pl_module):
            self.finite_after_first = parameters_finite(pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._close_meters()


def synthetic_batch(
    batch_size: int, obs_shape: tuple[int, ...], action_dim: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A replay batch of the run's shapes and dtypes (uint8 pixels or float32 states), on the CPU."""
    g = torch.Generator().manual_seed(seed)
    if len(obs_shape) == 3:
        obs = torch.randint(0, 256, (2, batch_size, *obs_shape), generator=g, dtype=torch.uint8)
    else:
        obs = torch.randn((2, batch_size, *obs_shape), generator=g)
    return {
        "obs": obs[0],
        "action": torch.rand(batch_size, action_dim, generator=g) * 2 - 1,
        "reward": torch.rand(batch_size, 1, generator=g),
        "not_terminal": torch.ones(batch_size, 1),
        "next_obs": obs[1],
    }


#: Where a batch is when the update starts: pageable host memory, page-locked (pinned) host
#: memory, or already on the training device.
BATCH_SOURCES = ("host", "pinned", "device")


def place_batch(batch: dict[str, torch.Tensor], source: str, device: torch.device) -> dict[str, torch.Tensor]:
    """``batch`` (host tensors) where ``source`` says: as it is (``host``), copied into pinned
    memory (``pinned``, CUDA only) or onto ``device`` (``device``). The update then copies it
    the way a run's batches are copied: synchronously from pageable memory, asynchronously from
    pinned memory, or not at all."""
    if source not in BATCH_SOURCES:
        raise ValueError(f"batch source {source!r}; choose one of {', '.join(BATCH_SOURCES)}")
    if source == "pinned":
        return {k: v.pin_memory() for k, v in batch.items()}
    if source == "device":
        return {k: v.to(device) for k, v in batch.items()}
    return batch


def batch_source_of(replay: Any, device: torch.device) -> str:
    """Where a run's replay hands its batches to an update on ``device`` (:data:`BATCH_SOURCES`):
    ``device`` when the rings live on the training GPU (``replay.device``), ``pinned`` when host
    rings return page-locked batches (``pin_memory``, on by default for a CUDA run), else
    ``host``. A CPU run's batches are host tensors whatever the replay says."""
    if replay is None or device.type == "cpu":
        return "host"
    replay_device = getattr(replay, "device", None)
    if replay_device is not None and torch.device(replay_device).type != "cpu":
        return "device"
    rings = getattr(replay, "buffers", None) or [replay]
    return "pinned" if getattr(rings[0], "pin_memory", False) else "host"


def without_log_intervals(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (plain data) with a log interval no measured run reaches: no metric sync or
    health check inside the updates (a naive fp16 agent is measured to the end, not stopped at
    its first NaN). The caller's dict is left as it is."""
    return {**config, "train": {**config["train"], "log_every_updates": _NEVER}}


def metered_updates(
    config: dict[str, Any],
    obs_shape: tuple[int, ...],
    action_dim: int,
    updates: int,
    meter: Callable[[], Any],
    device: torch.device | str = "cpu",
    callbacks: list[L.Callback] | None = None,
) -> list[tuple[bool, Any]]:
    """A fresh agent built from ``config`` (plain data, seeded with its ``seed``) fitted on
    ``device`` over ``updates`` updates of one synthetic batch of its ``agent.batch_size``, each
    update inside a fresh ``meter()`` context (a dispatch mode: a dispatch or FLOP counter).
    Returns ``(full update?, meter)`` per update, in order. The caller's random streams are left
    as they were."""
    from torch.utils.data import DataLoader

    device = torch.device(device)
    metered: list[tuple[bool, Any]] = []
    fork_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices), quiet_lightning():
        torch.manual_seed(int(config.get("seed", 0)))
        module = SACModule(config, tuple(obs_shape), action_dim)
        update = module.update

        def metering(batch: Any, with_actor: bool, with_target: bool) -> Any:
            with meter() as each:
                metrics = update(batch, with_actor, with_target)
            metered.append((with_actor, each))
            return metrics

        module.update = metering
        batch_size = int(config["agent"]["batch_size"])
        batch = synthetic_batch(batch_size, tuple(obs_shape), action_dim, seed=int(config.get("seed", 0)))
        trainer = bare_trainer(device, list(callbacks or []))
        trainer.fit(module, DataLoader([batch] * updates, batch_size=None))
    del trainer, module
    gc.collect()
    return metered


def bare_trainer(device: torch.device, callbacks: list[L.Callback]) -> L.Trainer:
    """A Trainer on ``device`` that runs one epoch of updates and nothing else: no logger,
    checkpoints, progress bar or summary, the module's own dtypes (``32-true``: Lightning casts
    nothing). For measuring updates (timing, memory, dispatch counts) outside a training run."""
    placement = (
        {"accelerator": "cuda", "devices": [device.index or 0]}
        if device.type == "cuda"
        else {
            "accelerator": device.type,
            "devices": 1,
        }
    )
    return L.Trainer(
        **placement,
        max_epochs=1,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


EMULATION_CHOICES = ("saves_low", "saves_fp32", "interleaved")


def time_updates(
    config: dict[str, Any],
    obs_shape: tuple[int, ...],
    action_dim: int,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    updates: int,
    warmup: int,
    prepare: Callable[[L.LightningModule], None] | None = None,
    emulation: str | None = None,
    tensor_peak: bool | None = None,
    meter_saved: bool = True,
) -> TimedUpdates:
    """Build a fresh ``SACModule`` from ``config`` and time ``updates`` of its real training steps
    on ``batch`` after ``warmup`` untimed ones, under a throwaway Trainer on ``device``.

    Both counts are rounded up to whole update cycles (:func:`pixelsac.graphs.update_cycle`), so
    the timed updates start at a full update and hold critic-only and full updates in a run's
    proportions. With ``perf.cuda_graphs`` (on a GPU) the warm-up first runs every graph's eager
    warm-up and capture, which are never timed: the times are replays, as in the run; the peak
    is then read from before the first update, so the graphs' pool is counted.
    After the fit the module and Trainer are freed (their reference cycles collected), so a
    second call starts from the same allocated bytes.

    ``prepare(module)`` may change the module before it is fitted (memory format, compilation).
    The caller's random streams are left as they were (the fork is restored afterwards), so a
    calibration at start-up does not change the run that follows it. The first update (the
    critic, the actor and the temperature) runs under a :class:`SavedTensorMeter`.

    ``emulation`` picks what the CPU emulation (``lowp.fp32_accumulate``, where the policy runs
    it) saves for backward: ``"saves_low"`` the fp16/bf16 inputs (the library's default),
    ``"saves_fp32"`` their fp32 copies (the earlier form), ``"interleaved"`` both, alternating
    in this one run (:func:`interleaved_forms`) so that their times share the machine's state;
    their times are in ``ms_by_form``. None leaves the policy as it is.

    ``tensor_peak`` (default: on a CPU) meters the first update with a :class:`TensorPeakMeter`
    too (a Python call per op: leave it off for compiled networks). ``meter_saved=False`` leaves
    out the :class:`SavedTensorMeter`: compiled networks need that (dynamo traces its pack hook
    into the first compile and fails on torch 2.13: "Guard failed on the same frame it was
    created"), and their saved tensors are AOTAutograd's choice, not the eager graph's.
    """
    from torch.utils.data import DataLoader

    if emulation is not None and emulation not in EMULATION_CHOICES:
        raise ValueError(f"emulation={emulation!r}; choose one of {', '.join(EMULATION_CHOICES)} or None")
    forms = None
    if emulation is not None and emulation != "interleaved":
        forms = [emulation == "saves_low"]
    # No metric sync or health check inside the timed steps: they come every log interval in a
    # run, and a naive fp16 agent must be timed to the end rather than stopped at its first NaN.
    config = without_log_intervals(config)
    device = torch.device(device)
    agent = config["agent"]
    actor_every, target_every = int(agent["actor_update_every"]), int(agent["critic_target_update_every"])
    cycle = update_cycle(actor_every, target_every)
    whole = lambda n: -(-int(n) // cycle) * cycle  # noqa: E731 -- rounded up to whole cycles
    warmup, updates = whole(warmup), whole(updates)
    graphs = bool((config.get("perf") or {}).get("cuda_graphs")) and device.type == "cuda"
    setup = 0
    if graphs:
        graph_warmup = int(config["perf"].get("graph_warmup_updates", 3))
        setup = whole(updates_to_capture(actor_every, target_every, graph_warmup))
    if emulation == "interleaved":
        forms = interleaved_forms(warmup, updates)
    fork_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices), quiet_lightning():
        torch.manual_seed(int(config.get("seed", 0)))
        gc.collect()  # what an earlier cell or calibration left in reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
        allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        module = SACModule(config, obs_shape, action_dim)
        if prepare is not None:
            prepare(module)
        if tensor_peak is None:
            tensor_peak = device.type != "cuda"
        probe = _Probe(
            setup + warmup, forms, tensor_peak, reset_peak_at=0 if graphs else setup + warmup, meter_saved=meter_saved
        )
        trainer = bare_trainer(device, [probe])
        trainer.fit(module, DataLoader([batch] * (setup + warmup + updates), batch_size=None))
        ms = probe.clock.drain()  # graph warm-ups and captures are not in it (UpdateTimer)
        ms = ms[max(len(ms) - updates, 0) :]
        peak = None
        if probe.peak is not None:
            peak = max(probe.peak.read() - allocated_before, 0)
        ms_by_form = None
        if emulation == "interleaved":
            ms_by_form = {
                name: [t for t, low in zip(ms, forms[warmup:]) if low == flag] for flag, name in EMULATION_FORMS.items()
            }
        pool = module.update_graphs.pool_bytes() if graphs and module.update_graphs is not None else None
        result = TimedUpdates(
            ms=ms,
            state=state_bytes(module, trainer.optimizers),
            peak_bytes=peak,
            finite_after_first=bool(probe.finite_after_first) if probe.finite_after_first is not None else True,
            finite_at_end=parameters_finite(module),
            skipped=dict(module.skipped),
            loss_scales=module.loss_scales(),
            saved=probe.saved,
            state_groups=state_groups(module, trainer.optimizers),
            ms_by_form=ms_by_form,
            tensor_peak_bytes=probe.tensor_peak_bytes,
            warmup=warmup,
            graph_setup_updates=probe.graph_setup_updates,
            graph_pool_bytes=pool,
        )
    # The Trainer and the module refer to each other (and the probe to both): without a
    # collection they outlive this call, and the next cell's baseline holds them.
    del trainer, module, probe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def fp32_reference_config(config: dict[str, Any]) -> dict[str, Any]:
    """The same agent in fp32 as DrQ published it: precision fp32, every lowp switch unset."""
    reference = copy.deepcopy(dict(config))
    reference["precision"] = "fp32"
    reference["lowp"] = {
        **reference["lowp"],
        "all": None,
        "fp32_accumulate": None,
        **{name: None for name in SIX},
    }
    return reference


@dataclasses.dataclass
class Fp32Reference:
    """The start-up calibration: an fp32 copy of the agent timed on a batch of the run's shapes."""

    ms_per_update: float
    ms_std: float
    updates: int
    warmup: int
    state: dict[str, int]
    peak_bytes: int | None
    seconds: float
    saved: dict[str, Any] | None = None  # SavedBytes as a dict
    state_groups: dict[str, dict[str, int]] | None = None
    host_other_cores: float | None = None  # other processes' CPU use during it (HostLoad)
    host_busy: bool = False  # they used >= meters.BUSY_OTHER_CORES: the estimate is unreliable
    host_load: str | None = None  # HostLoad.describe()
    cuda_graphs: bool = False  # timed as graph replays, like the run
    graph_setup_updates: int = 0  # graph warm-ups and captures, untimed
    batch_source: str = "host"  # where its batch was, as the run's (BATCH_SOURCES; "host" before it was said)

    def describe(self) -> str:
        """What this figure is: a short estimate at start-up, how many updates, how reliable."""
        graphs = ", CUDA graph replays" if self.cuda_graphs else ""
        where = {"pinned": ", batches in pinned host memory", "device": ", batches on the device"}.get(
            self.batch_source, ""
        )
        text = f"fp32 start-up estimate over {self.updates} updates (after {self.warmup} warm-up{graphs}{where})"
        if self.host_busy:
            text += f"; unreliable: the host was busy ({self.host_load})"
        return text
