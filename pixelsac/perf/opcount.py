"""What one update asks of a GPU, counted on any device: aten ops, kernels, dtype casts, host reads.

A GPU pays a kernel launch (5-10 µs of host time) per op, a cast is a pass over memory that
computes nothing, and a host read is a device-to-host synchronisation (and an error inside CUDA
graph capture). Two parts:

* :class:`DispatchCount`, the counter: a ``TorchDispatchMode`` that counts all three on any
  device, a CPU included (below);
* :func:`count_update_ops`: a fresh agent built from a run's (or a benchmark cell's)
  configuration, fitted (on the CPU unless told), each update counted with :class:`DispatchCount`:
  full updates (critic, actor, temperature and, when due, the target) and critic-only ones,
  after the first update cycle (whose first updates of each kind create the optimizer state and
  the cached constants) -- the benchmark's op, kernel, cast and host-read columns.

**The counter.** One entry per op that the Python code issues, views included, a foreach op
once. Ops that an op decomposes into below the dispatcher's Python key (a CPU foreach op's
per-tensor loop, the ``copy_`` inside ``_to_copy``) are not counted. A TorchFunctionMode would
miss the reads below the Python API (a 0-dim tensor handed to ``torch._foreach_add_`` picks its
Scalar overload, which reads the value in C++); a dispatch mode sees them.

Counted so, views make up a large share of an update's ops (docs/performance.md) and launch
nothing; and a foreach op that CUDA cannot run as one multi-tensor kernel runs tensor by tensor.
So a second figure estimates the **kernels** a GPU launches (:attr:`DispatchCount.kernels`):
every op once, except views, bare allocations and the profiler's markers (``record_function``
around every optimizer step: host-side only), which count 0, and a foreach op once where ATen's
CUDA fast-route test (``can_use_fast_route``, modelled by :func:`cuda_foreach_launches`) takes
it, else once per tensor: every tensor of every list of one dtype (a copy may cast) and device
and dense, paired tensors of one shape and strides, a 0-dim tensor operand of the lists' dtype, a
Python scalar that does not promote them, a norm of order 1, 2 or inf. A list of per-tensor 0-dim
scales, or an fp32 factor for fp16 moments, takes the per-tensor loop. An op registered by the
project (hAdam's compiled step, the compiled loss-scaler bookkeeping, target update and
division) counts once, whatever inductor generated inside it. An estimate:
a fast-route foreach op may take a second kernel per ~100k-element chunk list, and ATen ops launch
one kernel or a few. A GPU launches about one kernel per op that is not a view, so the kernel
estimate is what a small batch pays in launches.

What counts as what:

* **op**: any aten op reaching the dispatcher (:attr:`DispatchCount.total`).
* **cast**: an op that converts elements from one floating or integer dtype to another:
  ``aten._to_copy`` whose result dtype differs from its input's (``.to(dtype)``, ``.float()``,
  ``.half()``, ``type_as``), and ``aten.copy_`` / ``aten._foreach_copy_`` whose source dtype
  differs from the destination's (one cast per op, however many tensors it copies). A
  ``_to_copy`` that only moves a tensor or changes its memory format is not a cast; nor is an op
  that computes in another dtype on the way (``sum(dtype=...)``, type promotion).
* **host read**: ``aten._local_scalar_dense``, how ``.item()``, ``bool()``, ``float()`` and every
  Scalar argument built from a tensor read a value; and a copy from a device tensor into host
  memory (``aten._to_copy`` or ``aten.copy_`` from a non-CPU tensor to a CPU one: ``.cpu()``, and
  ``.tolist()`` or ``.numpy()`` of a GPU tensor). On a CPU only the first kind can occur (a CPU
  tensor's ``.cpu()`` dispatches nothing).

**The update, in the form a GPU runs it**, whatever machine counts it:

* ``perf.sync_free`` as configured, else on (CUDA's default); ``perf.channels_last`` and
  ``perf.aug_backend`` as configured, else CUDA's defaults (NHWC outside fp32; kornia's warp);
* no tensor-core emulation (``lowp.fp32_accumulate=false``), hAdam on whole buckets
  (``HAdam.chunk_for("cuda")``) and the finiteness checks in their foreach form
  (``lowp.finite.foreach_checks``), as on a GPU;
* eager and uncompiled (``perf.compile`` and ``perf.cuda_graphs`` off): a CUDA graph replays the
  kernels of the eager update it captured, and compilation fuses ops, which this count does not see.

Counted on a CPU, two choices stay a CPU's: fp32 with ``perf.sync_free=false`` steps torch's
foreach Adam (a GPU runs fused Adam either way), and torch's Adam in a pure fp16/bf16 mode without
hAdam (naive fp16, the no-hAdam ablation) reads its step counts on the host, as a CPU has no
capturable Adam. Counted on a GPU (the benchmark counts on its cell's device), nothing differs.

Sizes do not enter: the counts follow the number of layers and parameter tensors, not their
sizes, so the agent is counted at :data:`COUNT_SIZES` (batch 2, narrow layers) and a small image
(:func:`count_obs_shape`) -- an update in fp16 without the emulation runs a CPU's slow reference
kernels, and at full size would take seconds (tests/test_opcount.py holds the counts equal across
sizes).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import traceback
from typing import Any

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pixelsac.augment import default_backend
from pixelsac.graphs import update_cycle
from pixelsac.lowp import HAdam
from pixelsac.lowp.finite import foreach_checks
from pixelsac.perf.calibration import metered_updates, without_log_intervals

HOST_READ = torch.ops.aten._local_scalar_dense.default
_TO_COPY = torch.ops.aten._to_copy.default
_COPY = torch.ops.aten.copy_.default
_FOREACH_COPY = torch.ops.aten._foreach_copy_.default
#: ops that only allocate (no kernel): ``torch.empty*`` and the wrapping of a new tensor's value
_ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.lift_fresh.default,
    }
)


def _dtype(value: Any) -> torch.dtype | None:
    return value.dtype if isinstance(value, torch.Tensor) else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_cast(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Does this dispatched op convert elements between dtypes (module docstring)?"""
    if func is _TO_COPY:
        return _dtype(args[0]) is not None and _dtype(out) is not None and args[0].dtype != out.dtype
    if func is _COPY:
        return _dtype(args[0]) is not None and _dtype(args[1]) is not None and args[0].dtype != args[1].dtype
    if func is _FOREACH_COPY:
        return any(
            _dtype(dst) is not None and _dtype(src) is not None and dst.dtype != src.dtype
            for dst, src in zip(args[0], args[1])
        )
    return False


def _on_host(value: Any) -> bool | None:
    return value.device.type == "cpu" if isinstance(value, torch.Tensor) else None


def is_host_read(func: Any, args: tuple, out: Any) -> bool:
    """Does this dispatched op read device values on the host (module docstring)?"""
    if func is HOST_READ:
        return True
    if func is _TO_COPY:
        return _on_host(args[0]) is False and _on_host(out) is True
    if func is _COPY:
        return _on_host(args[1]) is False and _on_host(args[0]) is True
    return False


def _dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill one block of memory in some order of its
    dimensions (contiguous, channels-last, a transpose), as ATen's fast route requires."""
    if tensor.layout != torch.strided:
        return False
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def cuda_foreach_launches(func: Any, args: tuple, kwargs: dict) -> int:
    """How many ops a foreach op amounts to on CUDA: 1 where ATen's fast route takes it (one
    multi-tensor kernel), else the number of tensors it loops over (module docstring). Any other
    op: 1."""
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
    if not name.startswith("_foreach_"):
        return 1
    values = [*args, *kwargs.values()]
    lists = [v for v in values if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v)]
    if not lists:
        return 1
    first = lists[0]
    reference = first[0]
    copy = name.startswith("_foreach_copy")
    for tensors in lists:
        for tensor in tensors:
            if (not copy and tensor.dtype != reference.dtype) or tensor.device != reference.device:
                return len(first)
            if not _dense(tensor):
                return len(first)
    for tensors in lists[1:]:
        for a, b in zip(first, tensors):
            if a.shape != b.shape or any(n != 1 and x != y for n, x, y in zip(a.shape, a.stride(), b.stride())):
                return len(first)
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device == reference.device:
            if value.dtype != reference.dtype:  # the Tensor-scalar overloads' own test
                return len(first)
        elif isinstance(value, float) and not isinstance(value, bool):
            if not (reference.is_floating_point() or reference.is_complex()):
                return len(first)
    if name.startswith("_foreach_norm"):
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        if float(order) not in (1.0, 2.0, float("inf")) or not reference.is_floating_point():
            return len(first)
    return 1


def launches_nothing(func: Any) -> bool:
    """Views, bare allocations and the profiler's markers (``profiler::_record_function_*``, which
    torch's optimizers issue around every step) dispatch without launching a kernel."""
    return getattr(func, "is_view", False) or func in _ALLOCATIONS or func.namespace == "profiler"


class DispatchCount(TorchDispatchMode):
    """Inside ``with DispatchCount() as count:``, ``count.ops`` counts aten ops by overload,
    ``count.casts`` the casts by ``"from->to"`` dtypes and ``count.host_reads`` the host reads;
    ``count.read_sites`` and ``count.cast_sites`` say which project lines issued them (the
    deepest ``pixelsac`` frame, else the deepest torch frame). ``count.kernels`` estimates the
    kernels a GPU would launch (module docstring); ``count.per_tensor`` (and
    ``count.per_tensor_sites``) the foreach ops CUDA would loop over, with their tensor counts."""

    def __init__(self, sites: bool = True) -> None:
        super().__init__()
        self.sites = sites
        self.ops: collections.Counter = collections.Counter()
        self.casts: collections.Counter = collections.Counter()
        self.reads = 0
        self.read_sites: collections.Counter = collections.Counter()
        self.cast_sites: collections.Counter = collections.Counter()
        self.kernels = 0
        self.per_tensor: collections.Counter = collections.Counter()
        self.per_tensor_sites: collections.Counter = collections.Counter()

    @staticmethod
    def _site() -> str:
        stack = traceback.extract_stack()
        frames = [f for f in stack if "/pixelsac/" in f.filename and "/perf/opcount.py" not in f.filename]
        frames = frames or [f for f in stack if "/torch/" in f.filename]
        site = frames[-1] if frames else None
        return f"{site.filename.rsplit('/', 2)[-1]}:{site.lineno}" if site else "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func)] += 1
        if launches_nothing(func):
            launches = 0
        else:  # before the op runs: an in-place op may change its inputs
            launches = cuda_foreach_launches(func, args, kwargs)
        self.kernels += launches
        if launches > 1:
            self.per_tensor[str(func)] += launches
            if self.sites:
                self.per_tensor_sites[self._site()] += launches
        out = func(*args, **kwargs)
        if is_host_read(func, args, out):
            self.reads += 1
            if self.sites:
                self.read_sites[self._site()] += 1
        if func in (_TO_COPY, _COPY, _FOREACH_COPY) and is_cast(func, args, kwargs, out):
            if func is _TO_COPY:
                source, target = args[0], out
            elif func is _COPY:
                source, target = args[1], args[0]
            else:  # the first pair that differs
                target, source = next((d, s) for d, s in zip(args[0], args[1]) if d.dtype != s.dtype)
            self.casts[f"{_name(source.dtype)}->{_name(target.dtype)}"] += 1
            if self.sites:
                self.cast_sites[self._site()] += 1
        return out

    @property
    def host_reads(self) -> int:
        return self.reads

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def cast_total(self) -> int:
        return sum(self.casts.values())


#: The sizes the agent is counted at (its layer counts and every switch stay as configured).
COUNT_SIZES = {"batch_size": 2, "num_filters": 4, "feature_dim": 8, "hidden_dim": 16}

KINDS = ("full", "critic-only")


@dataclasses.dataclass
class UpdateCounts:
    """The most each counted update of one kind dispatched (each figure its own maximum)."""

    ops: int
    kernels: int  # the estimate of what a GPU launches (DispatchCount.kernels)
    casts: int
    host_reads: int
    casts_by_dtypes: dict[str, int]  # "float16->float32": n, from the update with the most casts
    updates: int  # how many updates of this kind were counted


def gpu_form(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (plain data) with the device-dependent choices made as on a GPU (module
    docstring) and the sizes of :data:`COUNT_SIZES`; the caller's dict is left as it is."""
    config = copy.deepcopy(dict(config))
    perf = dict(config.get("perf") or {})
    if perf.get("sync_free") is None:
        perf["sync_free"] = True
    if perf.get("channels_last") is None:
        perf["channels_last"] = config["precision"] != "fp32"
    if perf.get("aug_backend") is None:
        perf["aug_backend"] = default_backend("cuda")
    perf.update(compile=False, cuda_graphs=False)
    config["perf"] = perf
    config["lowp"] = {**config["lowp"], "fp32_accumulate": False}
    config["agent"] = {**config["agent"], **COUNT_SIZES}
    return without_log_intervals(config)


def count_obs_shape(obs_shape: tuple[int, ...], num_conv_layers: int) -> tuple[int, ...]:
    """Pixels at a side whose last convolution still outputs 2x2 (``4·layers + 1``: stride 2,
    then 1s), no larger than they are -- at 1x1 a channels-last output is contiguous too, and
    flattening it costs fewer ops than at any larger size; state vectors as they are."""
    if len(obs_shape) != 3:
        return tuple(obs_shape)
    side = min(obs_shape[-1], 4 * num_conv_layers + 1)
    return (obs_shape[0], side, side)


class _GpuOptimizers(L.Callback):
    """hAdam on whole buckets and the Kahan-momentum target in whole passes, as
    :meth:`HAdam.chunk_for` picks for a GPU."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            raw = getattr(optimizer, "optimizer", optimizer)
            if isinstance(raw, HAdam):
                raw.chunk_numel = HAdam.chunk_for("cuda")
        updater = getattr(pl_module, "target_updater", None)
        if updater is not None and hasattr(updater, "chunk_numel"):
            updater.chunk_numel = HAdam.chunk_for("cuda")


def count_update_ops(
    config: dict[str, Any],
    obs_shape: tuple[int, ...],
    action_dim: int,
    cycles: int = 1,
    device: torch.device | str = "cpu",
) -> dict[str, UpdateCounts]:
    """Count ``cycles`` whole update cycles (:func:`pixelsac.graphs.update_cycle`) of a fresh agent
    built from ``config`` after one uncounted cycle, in the GPU's form (module docstring), on
    ``device`` (on a GPU the form is the GPU's own). Returns an :class:`UpdateCounts` per kind of
    update that occurred (``full``, ``critic-only``). The caller's random streams are left as
    they were."""
    config = gpu_form(config)
    agent = config["agent"]
    shape = count_obs_shape(tuple(obs_shape), int(agent["num_conv_layers"]))
    cycle = update_cycle(int(agent["actor_update_every"]), int(agent["critic_target_update_every"]))
    with foreach_checks(True):
        metered = metered_updates(
            config,
            shape,
            action_dim,
            (1 + cycles) * cycle,
            lambda: DispatchCount(sites=False),
            device,
            [_GpuOptimizers()],
        )
    counted = [("full" if full else "critic-only", count) for full, count in metered]
    result = {}
    for kind in KINDS:
        counts = [count for name, count in counted[cycle:] if name == kind]
        if counts:
            most_cast = max(counts, key=lambda c: c.cast_total)
            result[kind] = UpdateCounts(
                ops=max(c.total for c in counts),
                kernels=max(c.kernels for c in counts),
                casts=most_cast.cast_total,
                host_reads=max(c.host_reads for c in counts),
                casts_by_dtypes=dict(most_cast.casts),
                updates=len(counts),
            )
    return result
