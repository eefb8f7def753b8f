"""What an update costs: time and memory of the SAC update step, measured where it runs.

The pieces, all about one question -- how fast and how big is the update:

* :class:`UpdateClock` times updates. On a GPU it records CUDA events and reads them in bulk at
  the log interval, so no update waits for the device; on a CPU it reads ``perf_counter``.
* :class:`PeakMemory` reads peak memory since its last reset: ``torch.cuda.max_memory_allocated``
  on a GPU; on a CPU the process's resident-set high-water mark (``VmHWM``, reset each interval
  through ``/proc/self/clear_refs`` where the kernel allows it, else the lifetime peak
  ``ru_maxrss``). A CPU figure is the whole process (libraries, replay, envs), and says so.
* :class:`UpdateTimer` is a Lightning callback that times every training update: from the end
  of its batch fetch (or ``on_train_batch_start``, whichever comes later) to
  ``on_train_batch_end``. Collecting experience is part of the fetch, so it is not counted.
* :func:`time_updates` runs the real ``SACModule.training_step`` on one synthetic batch under a
  throwaway Trainer. The start-up fp32 calibration and ``python -m pixelsac.bench`` both use it.
* :class:`PerfTracker` is the run's callback: throughput, ms and peak memory per update, state
  bytes, loss scales and skipped steps in the logs (step = env frames), the ratio to an fp32
  copy of the agent calibrated at start-up, and an end-of-run summary (table, JSON, markdown).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import resource
import statistics
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pixelsac import lowp
from pixelsac.precision import state_bytes

MIB = 1024 * 1024
_NEVER = 2**62  # a log interval no timed run reaches
_now = time.perf_counter  # one name for the CPU clock, so a test can stand in for it

# Lightning announces the end of every training batch fetch through its profiler under this
# action (the only moment it announces between "batch in hand" and "step runs").
_FETCH_ACTION_SUFFIX = "train_dataloader_next"
_LIGHTNING_CHATTER = ("does not have many workers", "IterableDataset", "Total length of `DataLoader`",
                      "LeafSpec", "smaller than the logging interval", "Found `dataloader_iter`",
                      "experimental")


# --- clocks and memory probes ----------------------------------------------------------------
class UpdateClock:
    """Start/stop marks around updates; :meth:`drain` returns the closed spans in milliseconds.

    On a GPU the marks are CUDA events on the current stream: recording one costs the host
    microseconds and never waits, and :meth:`drain` waits once, for the newest event, before
    reading all of them. A start marked twice keeps the later mark.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._start: Any = None
        self._closed: list[tuple[Any, Any]] = []

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return _now()

    @property
    def running(self) -> bool:
        return self._start is not None

    def start(self) -> None:
        self._start = self._mark()

    def stop(self) -> None:
        if self._start is not None:
            self._closed.append((self._start, self._mark()))
            self._start = None

    def cancel(self) -> None:
        self._start = None

    def drain(self) -> list[float]:
        """Milliseconds of every span closed since the last drain (one device wait on a GPU)."""
        closed, self._closed = self._closed, []
        if not closed:
            return []
        if self.cuda:
            closed[-1][1].synchronize()  # stream order: every earlier event has completed too
            return [float(start.elapsed_time(end)) for start, end in closed]
        return [(end - start) * 1e3 for start, end in closed]


def _read_proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_high_water() -> bool:
    """Linux >= 4.0 resets VmHWM to the current RSS when "5" is written to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int | None:
    """The process's resident set size now (None where /proc is absent)."""
    kib = _read_proc_status_kib("VmRSS")
    return None if kib is None else kib * 1024


def rss_peak_bytes() -> int:
    """The process's resident-set high-water mark (since start, or since the last reset)."""
    kib = _read_proc_status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class PeakMemory:
    """Peak memory since the last :meth:`reset`, in bytes; :attr:`kind` names what was measured."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.kind = "cuda_max_allocated"
            self.metric = "perf/peak_cuda_allocated_mib"
        else:
            self.kind = "rss_high_water" if _reset_rss_high_water() else "rss_high_water_since_start"
            self.metric = "perf/peak_rss_mib"

    def describe(self) -> str:
        return {
            "cuda_max_allocated": "torch.cuda.max_memory_allocated, reset every log interval (tensors only)",
            "rss_high_water": "process resident-set high-water mark (VmHWM), reset every log interval; "
                              "the whole process: libraries, replay buffer and envs included",
            "rss_high_water_since_start": "process resident-set high-water mark since start (ru_maxrss; "
                                          "this kernel cannot reset it); the whole process",
        }[self.kind]

    def reset(self) -> None:
        if self.kind == "cuda_max_allocated":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "rss_high_water":
            _reset_rss_high_water()

    def read(self) -> int:
        if self.kind == "cuda_max_allocated":
            return int(torch.cuda.max_memory_allocated(self.device))
        return rss_peak_bytes()


# --- memory where it is spent -----------------------------------------------------------------
def _storage(tensor: torch.Tensor) -> tuple[Any, int, Any]:
    """(identity, bytes, storage object) of the memory a tensor keeps alive: its whole storage,
    views included. The storage object is None for layouts without a plain storage."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes(), storage
    except (RuntimeError, NotImplementedError):  # sparse, mkldnn, ...: the tensor's own bytes
        return ("tensor", id(tensor)), tensor.numel() * tensor.element_size(), None


class _Held:
    """What the meter's pack hook hands autograd in place of a saved tensor; its end (autograd
    frees a node's saved tensors after the node's backward) tells the meter."""

    __slots__ = ("tensor", "_meter", "_key", "_nbytes")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter, key: Any, nbytes: int) -> None:
        self.tensor, self._meter, self._key, self._nbytes = tensor, meter, key, nbytes

    def __del__(self) -> None:
        self._meter._release(self._key, self._nbytes)


@dataclasses.dataclass
class SavedBytes:
    """What :class:`SavedTensorMeter` counted (bytes; see there)."""

    activations: int                  # saved tensors other than state, each storage once
    state: int                        # parameters/buffers saved (already counted in the state bytes)
    peak_live_activations: int        # the most saved activation bytes alive at one moment
    by_dtype: dict[str, int]          # activations by dtype ("float16", "float32", ...)
    tensors: int                      # tensors saved (views and repeats included)

    @property
    def total(self) -> int:
        return self.activations + self.state


class SavedTensorMeter:
    """Bytes of the tensors autograd saves for backward while this context is active.

    A ``torch.autograd.graph.saved_tensors_hooks`` pack hook sees every tensor an autograd node
    keeps for its backward pass -- built-in ops and custom autograd Functions
    (``ctx.save_for_backward``) alike -- so the count is exact and the same on a CPU and a GPU,
    unlike a process's resident set or an allocator's peak, which also hold transient buffers,
    kernel workspaces, caches and libraries. A saved tensor is counted by the storage it keeps
    alive (a view keeps its whole base), and a storage once however many nodes or views save it
    while it lives (its address can come back for a new storage after it is freed, and then
    counts anew).

    Storages of ``state`` (parameters and buffers: a linear layer saves its weight) are counted
    apart in :attr:`SavedBytes.state`; the state bytes count them already.
    :attr:`SavedBytes.peak_live_activations` is the most activation bytes saved and not yet
    released at one moment (for SAC: the critic's graph just before its backward). The hooks
    change no value; they cost a Python call per saved tensor.
    """

    def __init__(self, state: Iterable[torch.Tensor] = ()) -> None:
        self._state = {key for key, _, _ in map(_storage, state)}
        self._state_seen: set[Any] = set()
        self._seen: set[Any] = set()            # activation storages counted and still alive
        self._live: dict[Any, int] = {}         # saved references not yet released, per storage
        self._live_bytes = 0
        self.activations = 0
        self.state = 0
        self.peak_live = 0
        self.by_dtype: dict[str, int] = {}
        self.tensors = 0
        self._hooks: Any = None

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> Any:
        self.tensors += 1
        key, nbytes, storage = _storage(tensor)
        if key in self._state:
            if key not in self._state_seen:
                self._state_seen.add(key)
                self.state += nbytes
            return tensor.detach()
        if key not in self._seen:
            self._seen.add(key)
            if storage is not None:
                weakref.finalize(storage, self._seen.discard, key)
            self.activations += nbytes
            dtype = str(tensor.dtype).removeprefix("torch.")
            self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + nbytes
        live = self._live.get(key, 0)
        self._live[key] = live + 1
        if live == 0:
            self._live_bytes += nbytes
            self.peak_live = max(self.peak_live, self._live_bytes)
        # Detached: a saved output holding its own grad_fn would close a reference cycle through
        # the graph (node -> saved tensor -> node) that outlives a graph no backward ever frees.
        return _Held(tensor.detach(), self, key, nbytes)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, key: Any, nbytes: int) -> None:
        live = self._live.get(key, 0) - 1
        if live > 0:
            self._live[key] = live
        elif live == 0:
            del self._live[key]
            self._live_bytes -= nbytes

    def result(self) -> SavedBytes:
        return SavedBytes(self.activations, self.state, self.peak_live, dict(self.by_dtype), self.tensors)


class TensorPeakMeter(TorchDispatchMode):
    """The most bytes of tensors alive at one moment among those created while this is active:
    on a CPU, what ``torch.cuda.max_memory_allocated`` minus the bytes allocated before says on a
    GPU.

    Every op runs through this mode; a storage that an op returns and that is none of its
    inputs' (not a view, not an in-place or ``out=`` result) was allocated by the op, and a
    finalizer subtracts it when it is freed. Not counted: tensors from before (parameters, the
    batch) and memory a kernel allocates for itself without returning it (oneDNN's reorders and
    scratchpads), which the process's resident set holds, with the allocator's free holes. It
    costs a Python call per op, so it meters one update, untimed; it is not for compiled code.
    """

    def __init__(self) -> None:
        super().__init__()
        self._alive: set[Any] = set()
        self._bytes = 0
        self.peak = 0

    def _freed(self, key: Any, nbytes: int) -> None:
        if key in self._alive:
            self._alive.discard(key)
            self._bytes -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t)[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            key, nbytes, storage = _storage(tensor)
            if storage is None or not nbytes or key in inputs or key in self._alive:
                continue
            self._alive.add(key)
            self._bytes += nbytes
            weakref.finalize(storage, self._freed, key, nbytes)
        self.peak = max(self.peak, self._bytes)
        return out


def module_state_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers: the state tensors an update's autograd graph may save."""
    return [*module.parameters(), *module.buffers()]


def _group_bytes(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Bytes per group name, each storage counted once, in the first group that holds it."""
    seen: set[Any] = set()
    groups: dict[str, int] = {}
    for group, tensor in named:
        key, nbytes, _ = _storage(tensor)
        groups.setdefault(group, 0)
        if key not in seen:
            seen.add(key)
            groups[group] += nbytes
    return {group: nbytes for group, nbytes in groups.items() if nbytes}


def _network(name: str, depth: int) -> str:
    return ".".join(name.split(".")[:depth])


def state_groups(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, dict[str, int]]:
    """The learner's persistent state bytes by kind and, within a kind, by group.

    The kinds are those of :func:`pixelsac.precision.state_bytes` (and each sums to its figure):
    ``parameters`` by network, the first two levels of the name (``critic.trunk``,
    ``critic.proj``, ``actor.policy``, ``log_alpha``); ``optimizer`` by state key, whatever the
    optimizers keep per parameter (``exp_avg``, ``exp_avg_sq``, ``exp_avg_root``,
    ``kahan_comp``, ...; scalars such as step counts are left out, as there); ``target`` by
    owner: frozen parameters by network (``critic_target``) and buffers by the module that
    registers them (``target_updater.scaled_params``, ``target_updater.kahan_comp``). Nothing
    here is a fixed list: a new optimizer-state key or buffer shows up as a group of its own.
    """
    named = list(module.named_parameters())
    groups = {
        "parameters": _group_bytes((_network(n, 2), p) for n, p in named if p.requires_grad),
        "optimizer": _group_bytes((key, value) for opt in optimizers for st in opt.state.values()
                                  for key, value in st.items() if torch.is_tensor(value) and value.dim() > 0),
        "target": _group_bytes([*((_network(n, 1), p) for n, p in named if not p.requires_grad),
                                *((n.rpartition(".")[0] or n, b) for n, b in module.named_buffers()
                                  if b.is_floating_point())]),
    }
    return groups


def group_ratios(groups: dict[str, dict[str, int]] | None,
                 fp32_groups: dict[str, dict[str, int]] | None) -> dict[str, dict[str, float | None]] | None:
    """Each group's bytes ÷ the fp32 agent's bytes for the group of the same name (None where
    fp32 has no such group: fp32 Adam keeps ``exp_avg_sq``, hAdam ``exp_avg_root``)."""
    if groups is None or fp32_groups is None:
        return None
    return {kind: {name: ratio(nbytes, fp32_groups.get(kind, {}).get(name)) for name, nbytes in members.items()}
            for kind, members in groups.items()}


# --- timing updates inside a Trainer ---------------------------------------------------------
class _FetchListener:
    """Stands in for ``trainer.profiler``, forwarding every call to it, and calls ``on_fetched``
    when a training batch fetch ends. Lightning has no hook between "batch fetched" and "step
    runs"; with ``training_step(dataloader_iter)`` the fetch (an env step and a replay sample)
    happens inside the step, and only the profiler hears where it ends."""

    def __init__(self, inner: Any, on_fetched: Callable[[], None]) -> None:
        self._inner = inner
        self._on_fetched = on_fetched

    def start(self, action_name: str) -> None:
        self._inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self._inner.stop(action_name)
        if action_name.endswith(_FETCH_ACTION_SUFFIX):
            self._on_fetched()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class UpdateTimer(L.Callback):
    """Times each training update with an :class:`UpdateClock` (built for the Trainer's device).

    The span opens at ``on_train_batch_start`` and opens again when a batch fetch ends inside
    the step, so it covers moving and casting the batch, the three losses and optimizer steps
    and the target update, but not experience collection. It closes at this callback's
    ``on_train_batch_end``, and is dropped when the module's ``updates`` counter did not move
    (an epoch's last step finds the iterator empty and updates nothing). Place the callback
    first, before any callback that works there (evaluation, checkpoints, the progress bar), or
    that work is timed too -- :meth:`setup` warns otherwise.
    """

    def __init__(self) -> None:
        self.clock: UpdateClock | None = None
        self._listener: _FetchListener | None = None
        self._updates_at_start: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.clock = UpdateClock(trainer.strategy.root_device)
        self._listener = _FetchListener(trainer.profiler, self._on_fetched)
        trainer.profiler = self._listener
        before = trainer.callbacks[: trainer.callbacks.index(self)] if self in trainer.callbacks else []
        busy = [type(c).__name__ for c in before if type(c).on_train_batch_end is not L.Callback.on_train_batch_end]
        if busy:
            warnings.warn(f"{type(self).__name__} comes after {', '.join(busy)} in the callbacks; their "
                          "on_train_batch_end work is timed as part of each update (put it first)", stacklevel=2)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._listener is not None and trainer.profiler is self._listener:
            trainer.profiler = self._listener._inner
        self._listener = None

    def _on_fetched(self) -> None:
        if self.clock is not None and self.clock.running:
            self.clock.start()  # the batch is in hand: the update starts now

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._updates_at_start = getattr(pl_module, "updates", None)
        self.clock.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.updated(pl_module):
            self.clock.stop()
        else:
            self.clock.cancel()

    def updated(self, pl_module: Any) -> bool:
        """Whether the step that just ended ran an update (modules without a counter always do)."""
        return self._updates_at_start is None or getattr(pl_module, "updates", None) != self._updates_at_start


def apply_speed_options(module: Any, channels_last: bool, compile: bool, compile_mode: str = "default",
                        compile_backend: str = "inductor") -> None:
    """GPU-speed switches that need no change to the module's code (``perf.channels_last``,
    ``perf.compile``; the benchmark measures each on and off).

    ``channels_last``: every 4-D tensor of the module (conv weights of the critic, its target
    and the Kahan-momentum copies) in NHWC, so cuDNN runs the trunk's convolutions channels-last
    (a convolution follows its weight's memory format). ``compile``: ``nn.Module.compile`` on the
    trunk, projection and Q heads of the critic and its target, and on the actor -- in place, so
    parameter names, optimizers and checkpoints are unchanged. The augmentation, the losses'
    elementwise math and the optimizers stay eager.
    """
    if channels_last:
        module.to(memory_format=torch.channels_last)
    if compile:
        kwargs: dict[str, Any] = {"backend": compile_backend}
        if compile_backend == "inductor" and compile_mode != "default":
            kwargs["mode"] = compile_mode
        # a derived target (lowp.derived_target) runs the critic itself with other parameters
        for critic in filter(None, (module.critic, module.critic_target)):
            for part in (critic.trunk, critic.proj, critic.q1, critic.q2):
                part.compile(**kwargs)
        module.actor.compile(**kwargs)


def parameters_finite(module: torch.nn.Module) -> bool:
    """All floating parameters and buffers finite (one host sync)."""
    flags = [torch.isfinite(t).all() for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


@dataclasses.dataclass
class TimedUpdates:
    """What :func:`time_updates` measured."""

    ms: list[float]                   # each timed update (after the warm-up), milliseconds
    state: dict[str, int]             # precision.state_bytes: parameters, optimizer, target, total
    peak_bytes: int | None            # GPU: peak allocated over the timed updates above what was
                                      # allocated before the module was built; None on a CPU
    finite_after_first: bool          # parameters finite after the very first update
    finite_at_end: bool
    skipped: dict[str, int]           # skipped optimizer steps per loss, warm-up included
    loss_scales: dict[str, float]
    saved: SavedBytes | None = None   # saved for backward in the first (full) update
    state_groups: dict[str, dict[str, int]] | None = None   # state_groups(): by kind and group
    ms_by_form: dict[str, list[float]] | None = None        # interleaved emulation forms, timed
    tensor_peak_bytes: int | None = None  # TensorPeakMeter over the first update (CPU)

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
        if self._policy.mode != "amp" and self._policy.fp32_accumulate:
            return lowp.fp32_accumulate(save_low_precision=self.save_low_precision)
        return self._policy.compute_context()


def interleaved_forms(warmup: int, updates: int) -> list[bool]:
    """``save_low_precision`` for each update when two emulation forms are timed in one run:
    alternating through the warm-up, then A B B A from the first timed update on, so that each
    form gets as many even as odd updates (DrQ runs the actor on every other update)."""
    return [i % 2 == 0 for i in range(warmup)] + [(i % 4) in (0, 3) for i in range(updates)]


class _Probe(UpdateTimer):
    """UpdateTimer that also resets the peak-memory counter before the first timed update, checks
    the parameters after the first update (outside the timed span), meters what the first update
    saves for backward, and (``forms``) sets the emulation's form before each update."""

    def __init__(self, warmup: int, forms: list[bool] | None = None, tensor_peak: bool = False) -> None:
        super().__init__()
        self.warmup = warmup
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
        if self.started == self.warmup and self.peak is not None:
            self.peak.reset()
        if self.forms is not None:
            pl_module.precision_policy.save_low_precision = self.forms[min(self.started, len(self.forms) - 1)]
        if self.started == 0:  # update 0 runs the critic, the actor and the temperature
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


def synthetic_batch(batch_size: int, obs_shape: tuple[int, ...], action_dim: int,
                    seed: int = 0) -> dict[str, torch.Tensor]:
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


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's start-up lines for a throwaway Trainer say nothing a user can act on."""
    names = ("lightning.pytorch", "lightning.fabric")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for pattern in _LIGHTNING_CHATTER:
                warnings.filterwarnings("ignore", message=f".*{pattern}.*")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _trainer_device_args(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {"accelerator": "cuda", "devices": [device.index or 0]}
    return {"accelerator": device.type, "devices": 1}


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
) -> TimedUpdates:
    """Build a fresh ``SACModule`` from ``config`` and time ``updates`` of its real training steps
    on ``batch`` after ``warmup`` untimed ones, under a throwaway Trainer on ``device``.

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
    too (a Python call per op: leave it off for compiled networks).
    """
    from torch.utils.data import DataLoader

    from pixelsac.module import SACModule

    if emulation is not None and emulation not in EMULATION_CHOICES:
        raise ValueError(f"emulation={emulation!r}; choose one of {', '.join(EMULATION_CHOICES)} or None")
    forms = None
    if emulation == "interleaved":
        forms = interleaved_forms(warmup, updates)
    elif emulation is not None:
        forms = [emulation == "saves_low"]
    # No metric sync or health check inside the timed steps: they come every log interval in a
    # run, and a naive fp16 agent must be timed to the end rather than stopped at its first NaN.
    config = {**config, "train": {**config["train"], "log_every_updates": _NEVER}}
    device = torch.device(device)
    fork_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices), quiet_lightning():
        torch.manual_seed(int(config.get("seed", 0)))
        allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        module = SACModule(config, obs_shape, action_dim)
        if prepare is not None:
            prepare(module)
        if tensor_peak is None:
            tensor_peak = device.type != "cuda"
        probe = _Probe(warmup, forms, tensor_peak)
        trainer = L.Trainer(**_trainer_device_args(device), max_epochs=1, precision="32-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[probe])
        trainer.fit(module, DataLoader([batch] * (warmup + updates), batch_size=None))
        ms = probe.clock.drain()[warmup:]
        peak = None
        if probe.peak is not None:
            peak = max(probe.peak.read() - allocated_before, 0)
        ms_by_form = None
        if emulation == "interleaved":
            ms_by_form = {name: [t for t, low in zip(ms, forms[warmup:]) if low == flag]
                          for flag, name in EMULATION_FORMS.items()}
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
        )
    del trainer, module
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def fp32_reference_config(config: dict[str, Any]) -> dict[str, Any]:
    """The same agent in fp32 as DrQ published it: precision fp32, every lowp switch unset."""
    reference = copy.deepcopy(dict(config))
    reference["precision"] = "fp32"
    reference["lowp"] = {**reference["lowp"], "all": None, "fp32_accumulate": None,
                         **{name: None for name in ("hadam", "loss_scaling", "kahan_gradients",
                                                    "kahan_momentum", "softplus_fix", "normal_fix")}}
    return reference


# --- arithmetic shared by the tracker and the benchmark ---------------------------------------
def speedup(fp32_ms: float | None, ms: float | None) -> float | None:
    """fp32 ms/update ÷ this mode's ms/update (> 1: faster than fp32)."""
    if fp32_ms is None or ms is None or not ms > 0 or not math.isfinite(fp32_ms):
        return None
    return fp32_ms / ms


def ratio(value: float | None, fp32_value: float | None) -> float | None:
    """This mode's bytes ÷ fp32's bytes (< 1: smaller than fp32)."""
    if value is None or fp32_value is None or not fp32_value > 0:
        return None
    return value / fp32_value


def _optimizers_have_state(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Optimizer state is created at the first step actually taken (a skipped step creates none);
    state bytes are reported once it exists for every parameter."""
    return all(opt.state.get(p) for opt in optimizers for group in opt.param_groups for p in group["params"])


def _log(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def _fmt_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:,.1f} MiB"


def _fmt_ratio(x: float | None, what: str) -> str:
    return "" if x is None else f" ({x:.2f}x {what})"


# --- the run's callback ----------------------------------------------------------------------
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
    saved: dict[str, Any] | None = None                       # SavedBytes as a dict
    state_groups: dict[str, dict[str, int]] | None = None


class PerfTracker(UpdateTimer):
    """Logs throughput, ms and peak memory per update, state bytes, loss scales and skipped steps
    every ``train.log_every_updates`` updates (step = env frames), against an fp32 copy of the
    agent timed at start-up (``perf.calibrate_updates`` after ``perf.warmup_updates``), and writes
    the end-of-run summary (printed table, ``summary.json``, ``summary.md`` in ``run_dir``).

    ``collector`` supplies the counters (``total_env_frames``/``total_agent_steps`` over all ranks,
    or ``env_frames``/``agent_steps``; ``replay`` if it has one).
    Put it first in the Trainer's callbacks (see :class:`UpdateTimer`).
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
        self._to_discard = self.warmup_updates  # the run's own first updates warm up like calibration's
        self._ms_all: list[float] = []
        self._peak_max: int | None = None
        self._state: dict[str, int] | None = None
        self._groups: dict[str, dict[str, int]] | None = None
        self.actor_every = int(cfg.agent.actor_update_every)
        self.saved: SavedBytes | None = None   # what the first full update of the fit saved for backward
        self._meter: SavedTensorMeter | None = None
        self._last_logged = -1

    # --- start-up ---------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.peak = PeakMemory(trainer.strategy.root_device)

    def calibrate(self, module: Any, device: torch.device) -> Fp32Reference:
        """Time ``calibrate_updates`` updates of an fp32 copy of ``module``'s agent."""
        start = _now()
        batch = synthetic_batch(self.batch_size, module.obs_shape, module.action_dim, seed=self.seed)
        timed = time_updates(fp32_reference_config(module.hparams["config"]), module.obs_shape,
                             module.action_dim, batch, device, self.calibrate_updates, self.warmup_updates)
        return Fp32Reference(timed.mean_ms, timed.std_ms, len(timed.ms), self.warmup_updates, timed.state,
                             timed.peak_bytes, _now() - start,
                             dataclasses.asdict(timed.saved) if timed.saved is not None else None,
                             timed.state_groups)

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        device = trainer.strategy.root_device
        frames = self._env_frames()
        if self.calibrate_updates > 0 and trainer.is_global_zero:
            self.fp32 = self.calibrate(pl_module, device)
            row = {"perf/fp32_ms_per_update": self.fp32.ms_per_update,
                   "perf/fp32_state_bytes": self.fp32.state["total"]}
            if self.fp32.peak_bytes is not None:
                row["perf/fp32_peak_cuda_allocated_mib"] = self.fp32.peak_bytes / MIB
            if self.fp32.saved is not None:
                row["perf/fp32_saved_for_backward_bytes"] = self.fp32.saved["activations"]
            _log(trainer, {**row, **self._counters(pl_module)}, step=frames)
            print(f"perf: fp32 reference {self.fp32.ms_per_update:.1f} ms/update (batch {self.batch_size}, "
                  f"{self.fp32.updates} updates after {self.fp32.warmup} warm-up, {self.fp32.seconds:.1f} s), "
                  f"state {_fmt_bytes(self.fp32.state['total'])}")
        if trainer.is_global_zero:
            print(f"perf: peak memory = {self.peak.describe()}")
        self._fit_start = self._interval_start = _now()
        self._fit_frames = self._interval_frames = frames
        self._fit_agent_steps = self._agent_steps()
        self._fit_updates = self._interval_updates = pl_module.updates
        self.peak.reset()

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
            _log(trainer, {**self.interval_metrics(trainer, pl_module), **self._counters(pl_module)},
                 step=self._env_frames())

    def _env_frames(self) -> int:
        """Env frames over all data-parallel ranks (what every log's step counts)."""
        return int(getattr(self.collector, "total_env_frames", self.collector.env_frames))

    def _agent_steps(self) -> int:
        return int(getattr(self.collector, "total_agent_steps", self.collector.agent_steps))

    def _counters(self, module: Any) -> dict[str, float]:
        return {"env_frames": self._env_frames(), "agent_steps": self._agent_steps(),
                "updates": module.updates}

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
        now = _now()
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
            faster = speedup(self.fp32.ms_per_update, row["perf/ms_per_update"]) if self.fp32 else None
            if faster is not None:
                row["perf/speedup_vs_fp32"] = faster
        if _optimizers_have_state(trainer.optimizers):
            self._state = state_bytes(module, trainer.optimizers)
            self._groups = state_groups(module, trainer.optimizers)
            row.update({f"perf/state_bytes_{k}": v for k, v in self._state.items() if k != "total"})
            row.update({f"perf/state_bytes_{kind}/{name}": v
                        for kind, members in self._groups.items() for name, v in members.items()})
            row["perf/state_bytes"] = self._state["total"]
            if self.fp32 is not None:
                row["perf/memory_vs_fp32"] = ratio(self._state["total"], self.fp32.state["total"])
        if self.saved is not None:
            row["perf/saved_for_backward_bytes"] = self.saved.activations
            if self.fp32 is not None and self.fp32.saved is not None:
                row["perf/saved_for_backward_vs_fp32"] = ratio(self.saved.activations, self.fp32.saved["activations"])
        if self.fp32 is not None and self.fp32.peak_bytes is not None and self.peak.kind == "cuda_max_allocated":
            row["perf/peak_memory_vs_fp32"] = ratio(peak, self.fp32.peak_bytes)
        for name, scale in module.loss_scales().items():
            row[f"lowp/loss_scale_{name}"] = scale
        for name, count in module.skipped.items():
            row[f"lowp/skipped_{name}"] = count
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
            wall_s=_now() - self._fit_start,
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
        )
        write_summary(self.run_dir, self.summary)
        print(format_summary(self.summary))


def build_summary(*, precision: str, device: str, batch_size: int, env_frames: int, agent_steps: int,
                  updates: int, wall_s: float, ms: list[float], peak_bytes: int | None, peak_kind: str,
                  state: dict[str, int] | None, loss_scales: dict[str, float], skipped: dict[str, int],
                  best_eval_return: float | None, fp32: Fp32Reference | None,
                  replay_bytes: int | None = None, replay_bytes_per_transition: float | None = None,
                  stopped_by: str | None = None, saved: SavedBytes | None = None,
                  state_groups: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The end-of-run figures as plain data; every ratio is computed here from measured values.
    ``memory_figures`` says what each memory figure measures."""
    mean_ms = statistics.fmean(ms) if ms else None
    peak_vs_fp32 = None
    if fp32 is not None and fp32.peak_bytes is not None and peak_kind == "cuda_max_allocated":
        peak_vs_fp32 = ratio(peak_bytes, fp32.peak_bytes)
    fp32_saved = fp32.saved if fp32 is not None else None
    return {
        "precision": precision,
        "device": device,
        "batch_size": batch_size,
        "env_frames": env_frames,
        "agent_steps": agent_steps,
        "updates": updates,
        "wall_s": wall_s,
        "env_frames_per_s": env_frames / wall_s if wall_s > 0 else None,
        "updates_per_s": updates / wall_s if wall_s > 0 else None,
        "ms_per_update": mean_ms,
        "ms_per_update_std": statistics.pstdev(ms) if len(ms) > 1 else None,
        "timed_updates": len(ms),
        "peak_memory_bytes": peak_bytes,
        "peak_memory_kind": peak_kind,
        "state_bytes": state,
        "loss_scales": loss_scales,
        "skipped": skipped,
        "best_eval_return": best_eval_return,
        "replay_bytes": replay_bytes,
        "replay_bytes_per_transition": replay_bytes_per_transition,
        "fp32": dataclasses.asdict(fp32) if fp32 is not None else None,
        "speedup_vs_fp32": speedup(fp32.ms_per_update, mean_ms) if fp32 is not None else None,
        "memory_vs_fp32": ratio(state["total"], fp32.state["total"]) if fp32 is not None and state else None,
        "peak_memory_vs_fp32": peak_vs_fp32,
        "saved_for_backward": dataclasses.asdict(saved) if saved is not None else None,
        "saved_for_backward_vs_fp32": ratio(saved.activations, fp32_saved["activations"])
        if saved is not None and fp32_saved is not None else None,
        "state_groups": state_groups,
        "state_groups_vs_fp32": group_ratios(state_groups, fp32.state_groups if fp32 is not None else None),
        "memory_figures": MEMORY_FIGURES,
        "stopped_by": stopped_by,
    }


#: What each memory figure of the summary and the benchmark measures.
MEMORY_FIGURES = {
    "peak memory": "peak of the process: on a GPU torch.cuda.max_memory_allocated (tensors only); on a CPU the "
                   "resident-set high-water mark (the whole process: libraries, allocator caches, replay buffer, "
                   "envs; the benchmark reports it above the fresh process's baseline)",
    "tensor peak": "CPU: the most bytes of tensors alive at once during one full update among those it allocates "
                   "(op outputs; pixelsac.perf.TensorPeakMeter): what torch.cuda.max_memory_allocated says on a GPU, "
                   "less kernels' own workspaces; benchmark only",
    "saved for backward": "bytes of the tensors autograd keeps from the forward to the backward pass in one full "
                          "update (critic, actor, temperature), counted with torch.autograd.graph.saved_tensors_hooks: "
                          "exact and the same on a CPU and a GPU; each storage once; parameters that autograd saves "
                          "are left out (state counts them); 'at most ... at once' is the largest amount alive "
                          "together",
    "state": "parameters + optimizer state + target copies (pixelsac.precision.state_bytes), and by group: "
             "parameters by network, optimizer state by state key, target copies by network and buffer owner "
             "(pixelsac.perf.state_groups)",
}


def _fmt_saved(saved: dict[str, Any] | None, vs_fp32: float | None) -> str:
    if not saved:
        return "n/a"
    dtypes = ", ".join(f"{dtype} {_fmt_bytes(n)}" for dtype, n in sorted(saved["by_dtype"].items()))
    return (f"{_fmt_bytes(saved['activations'])} in one full update ({dtypes})" + _fmt_ratio(vs_fp32, "fp32's")
            + f"; at most {_fmt_bytes(saved['peak_live_activations'])} at once")


def _fmt_groups(members: dict[str, int], ratios: dict[str, float | None] | None) -> str:
    parts = []
    for name, nbytes in members.items():
        r = (ratios or {}).get(name)
        parts.append(f"{name} {_fmt_bytes(nbytes)}" + ("" if r is None else f" ({r:.2f}x)"))
    return ", ".join(parts) or "none"


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, value) pairs of the summary, in reading order, values already formatted."""
    fp32 = summary["fp32"]
    state = summary["state_bytes"]
    num = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    rows = [
        ("precision", summary["precision"]),
        ("device", summary["device"]),
        ("env frames", f"{summary['env_frames']:,}"),
        ("updates", f"{summary['updates']:,} (batch {summary['batch_size']})"),
        ("wall time", f"{summary['wall_s']:,.1f} s"),
        ("env frames / s", num(summary["env_frames_per_s"], ",.1f")),
        ("updates / s", num(summary["updates_per_s"], ",.2f")),
        ("ms / update", num(summary["ms_per_update"], ",.2f")
         + (f" (fp32 {fp32['ms_per_update']:,.2f}: {summary['speedup_vs_fp32']:.2f}x speed-up)"
            if fp32 and summary["speedup_vs_fp32"] is not None else "")),
        ("peak memory", _fmt_bytes(summary["peak_memory_bytes"]) + f" [{summary['peak_memory_kind']}]"
         + _fmt_ratio(summary["peak_memory_vs_fp32"], "fp32's")),
        ("state bytes", "n/a" if not state else
         f"{_fmt_bytes(state['total'])} = parameters {_fmt_bytes(state['parameters'])} + optimizer "
         f"{_fmt_bytes(state['optimizer'])} + target {_fmt_bytes(state['target'])}"
         + _fmt_ratio(summary["memory_vs_fp32"], "fp32's")),
        *((f"state: {kind}", f"{_fmt_bytes(sum(members.values()))}"
           + _fmt_ratio(ratio(state.get(kind), fp32["state"].get(kind)) if fp32 and state else None, "fp32's") + ": "
           + _fmt_groups(members, (summary.get("state_groups_vs_fp32") or {}).get(kind)))
          for kind, members in (summary.get("state_groups") or {}).items()),
        ("saved for backward",
         _fmt_saved(summary.get("saved_for_backward"), summary.get("saved_for_backward_vs_fp32"))),
        ("loss scales", ", ".join(f"{k} {v:g}" for k, v in summary["loss_scales"].items()) or "n/a"),
        ("skipped steps", ", ".join(f"{k} {v}" for k, v in summary["skipped"].items()) or "n/a"),
        ("best eval return", num(summary["best_eval_return"], ".1f")),
    ]
    if summary["replay_bytes"] is not None and summary["replay_bytes_per_transition"] is not None:
        rows.append(("replay buffer", f"{_fmt_bytes(summary['replay_bytes'])} "
                                      f"({summary['replay_bytes_per_transition']:,.0f} B/transition, uint8)"))
    if fp32 is None:
        rows.append(("fp32 reference", "not calibrated (perf.calibrate_updates=0)"))
    if summary.get("stopped_by"):
        rows.append(("stopped early", summary["stopped_by"]))
    return rows


def format_summary(summary: dict[str, Any]) -> str:
    rows = summary_rows(summary)
    width = max(len(what) for what, _ in rows)
    return "\n".join(["perf summary:", *(f"  {what:<{width}}  {value}" for what, value in rows)])


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such a figure was not measured, so it becomes null."""
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """``summary.json`` (raw numbers) and ``summary.md`` (the table) in ``run_dir``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n")
    lines = ["# Run summary", "", "| what | value |", "|---|---|"]
    lines += [f"| {what} | {value.replace('|', '/')} |" for what, value in summary_rows(summary)]
    lines += ["", "Memory figures (ratios: this run ÷ the fp32 copy timed at start-up, same batch):",
              *(f"- **{name}**: {text}" for name, text in summary.get("memory_figures", MEMORY_FIGURES).items())]
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")
