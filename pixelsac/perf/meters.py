"""Meters: what an update costs in time and memory, read where it runs.

* :class:`UpdateClock` times updates. On a GPU it records CUDA events and reads them in bulk at
  the log interval, so no update waits for the device; on a CPU it reads ``perf_counter``.
* :class:`PeakMemory` reads peak memory since its last reset: ``torch.cuda.max_memory_allocated``
  on a GPU; on a CPU the process's resident-set high-water mark (``VmHWM``, reset each interval
  through ``/proc/self/clear_refs`` where the kernel allows it, else the lifetime peak
  ``ru_maxrss``). A CPU figure is the whole process (libraries, replay, envs), and says so.
* :class:`SavedTensorMeter` counts the bytes autograd saves for backward, :class:`TensorPeakMeter`
  the most tensor bytes alive at once, :func:`state_groups` the learner's state by group.
* :class:`UpdateTimer` is a Lightning callback that times every training update: from the end
  of its batch fetch (or ``on_train_batch_start``, whichever comes later) to
  ``on_train_batch_end``. Collecting experience is part of the fetch, so it is not counted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pixelsac.precision import nonfinite_names

MIB = 1024 * 1024
_now = time.perf_counter  # one name for the CPU clock, so a test can stand in for it


# Lightning announces the end of every training batch fetch through its profiler under this
# action (the only moment it announces between "batch in hand" and "step runs").
_FETCH_ACTION_SUFFIX = "train_dataloader_next"


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


# --- how busy the host was ----------------------------------------------------------------------
#: Other processes using this many cores on average during a timing make it unreliable.
BUSY_OTHER_CORES = 0.5


def _system_busy_seconds() -> float | None:
    """CPU seconds all processes of the machine have spent (``/proc/stat``: user, nice, system,
    irq, softirq and steal, the hypervisor's share for other machines); None without /proc."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


@dataclasses.dataclass
class HostLoad:
    """How busy the machine was while something was timed (:class:`HostLoadMeter`)."""

    other_cores: float | None  # CPU seconds of every other process ÷ wall seconds (None: unknown)
    load_average: float | None  # 1-minute load average at the end
    cpus: int  # cores this process may run on

    @property
    def busy(self) -> bool:
        """Other processes used at least :data:`BUSY_OTHER_CORES` cores on average: a timing
        taken then says as much about them as about the update."""
        return self.other_cores is not None and self.other_cores >= BUSY_OTHER_CORES

    def describe(self) -> str:
        if self.other_cores is None:
            return "host load unknown (no /proc/stat)"
        load = "" if self.load_average is None else f", load average {self.load_average:.1f}"
        return f"other processes used {self.other_cores:.1f} of {self.cpus} cores{load}"


class HostLoadMeter:
    """Context manager: the CPU time all other processes spent while it was active, from the
    machine's busy time (``/proc/stat``) less this process's own (``os.times``)."""

    def __enter__(self) -> HostLoadMeter:
        self.result: HostLoad | None = None
        # real time, not the stand-in clock tests may put in _now: CPU seconds are real too
        self._start = (time.monotonic(), _system_busy_seconds(), _own_cpu_seconds())
        return self

    def __exit__(self, *exc: Any) -> None:
        wall0, busy0, own0 = self._start
        wall, busy, own = time.monotonic() - wall0, _system_busy_seconds(), _own_cpu_seconds() - own0
        other = None
        if busy is not None and busy0 is not None and wall > 0:
            other = max(busy - busy0 - own, 0.0) / wall
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = None
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.result = HostLoad(other, load, cpus)


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

    activations: int  # saved tensors other than state, each storage once
    state: int  # parameters/buffers saved (already counted in the state bytes)
    peak_live_activations: int  # the most saved activation bytes alive at one moment
    by_dtype: dict[str, int]  # activations by dtype ("float16", "float32", ...)
    tensors: int  # tensors saved (views and repeats included)

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
        self._seen: set[Any] = set()  # activation storages counted and still alive
        self._live: dict[Any, int] = {}  # saved references not yet released, per storage
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
    """Bytes per group name, each storage counted once. A storage that the listed tensors view in
    several places (hAdam's compiled step keeps a bucket's parameters, and each state tensor, as
    views into one flat buffer) is shared out by the bytes each view spans (an overlap counted
    once); what no view spans goes to the first group holding it."""
    groups: dict[str, int] = {}
    storages: dict[Any, tuple[int, str, dict[tuple[int, int], str]]] = {}
    for group, tensor in named:
        key, nbytes, _ = _storage(tensor)
        groups.setdefault(group, 0)
        _, _, spans = storages.setdefault(key, (nbytes, group, {}))
        span = (tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size())
        spans.setdefault(span, group)
    for nbytes, first, spans in storages.values():
        if len(spans) == 1:
            groups[first] += nbytes
            continue
        covered, reached = 0, None
        for (start, end), group in sorted(spans.items()):
            start = start if reached is None else max(start, reached)
            if end > start:
                groups[group] += end - start
                covered += end - start
                reached = end
        groups[first] += max(nbytes - covered, 0)
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
        "optimizer": _group_bytes(
            (key, value)
            for opt in optimizers
            for st in opt.state.values()
            for key, value in st.items()
            if torch.is_tensor(value) and value.dim() > 0
        ),
        "target": _group_bytes(
            [
                *((_network(n, 1), p) for n, p in named if not p.requires_grad),
                *((n.rpartition(".")[0] or n, b) for n, b in module.named_buffers() if b.is_floating_point()),
            ]
        ),
    }
    return groups


def group_ratios(
    groups: dict[str, dict[str, int]] | None, fp32_groups: dict[str, dict[str, int]] | None
) -> dict[str, dict[str, float | None]] | None:
    """Each group's bytes ÷ the fp32 agent's bytes for the group of the same name (None where
    fp32 has no such group: fp32 Adam keeps ``exp_avg_sq``, hAdam ``exp_avg_root``)."""
    if groups is None or fp32_groups is None:
        return None
    return {
        kind: {name: ratio(nbytes, fp32_groups.get(kind, {}).get(name)) for name, nbytes in members.items()}
        for kind, members in groups.items()
    }


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
    (an epoch's last step finds the iterator empty and updates nothing), and when the update
    was a CUDA graph's eager warm-up or its capture (``perf.cuda_graphs``: a replay's time is
    what the run spends from then on; :attr:`graph_setup_updates` counts them). Place the callback
    first, before any callback that works there (evaluation, checkpoints, the progress bar), or
    that work is timed too -- :meth:`setup` warns otherwise.
    """

    def __init__(self) -> None:
        self.clock: UpdateClock | None = None
        self._listener: _FetchListener | None = None
        self._updates_at_start: int | None = None
        self.graph_setup_updates = 0  # eager warm-ups and captures of CUDA graphs, not timed

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.clock = UpdateClock(trainer.strategy.root_device)
        self._listener = _FetchListener(trainer.profiler, self._on_fetched)
        trainer.profiler = self._listener
        before = trainer.callbacks[: trainer.callbacks.index(self)] if self in trainer.callbacks else []
        busy = [type(c).__name__ for c in before if type(c).on_train_batch_end is not L.Callback.on_train_batch_end]
        if busy:
            warnings.warn(
                f"{type(self).__name__} comes after {', '.join(busy)} in the callbacks; their "
                "on_train_batch_end work is timed as part of each update (put it first)",
                stacklevel=2,
            )

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
        graphs = getattr(pl_module, "update_graphs", None)
        if self.updated(pl_module) and graphs is not None and not graphs.replaying:
            self.graph_setup_updates += 1
            self.clock.cancel()
        elif self.updated(pl_module):
            self.clock.stop()
        else:
            self.clock.cancel()

    def updated(self, pl_module: Any) -> bool:
        """Whether the step that just ended ran an update (modules without a counter always do)."""
        return self._updates_at_start is None or getattr(pl_module, "updates", None) != self._updates_at_start


def parameters_finite(module: torch.nn.Module) -> bool:
    """All floating parameters and buffers finite (one host sync)."""
    return not nonfinite_names({"state": [*module.parameters(), *module.buffers()]})


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


def _fmt_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:,.1f} MiB"
