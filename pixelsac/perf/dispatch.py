"""Counting what an update asks of the device: every aten op, the dtype casts and the host reads.

A GPU pays a kernel launch (5-10 µs of host time) per op, a cast is a pass over memory that
computes nothing, and a host read is a device-to-host synchronisation (and an error inside CUDA
graph capture). All three are counted here on any device, a CPU included, by a
``TorchDispatchMode``: one entry per op that the Python code issues, views included, a foreach
op once. Ops that an op decomposes into below the dispatcher's Python key (a CPU foreach op's
per-tensor loop, the ``copy_`` inside ``_to_copy``) are not counted. A TorchFunctionMode would
miss the reads below the Python API (a 0-dim tensor handed to ``torch._foreach_add_`` picks its
Scalar overload, which reads the value in C++); a dispatch mode sees them.

Counted so, views make up a third to a half of an update's ops (fp32: 203 of 540), and launch
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
one kernel or a few.

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
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READ", "DispatchCount", "cuda_foreach_launches", "is_cast", "is_host_read", "launches_nothing"]

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
        frames = [f for f in stack if "/pixelsac/" in f.filename and "/perf/dispatch.py" not in f.filename]
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
