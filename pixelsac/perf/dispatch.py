"""Counting what an update asks of the device: every aten op, the dtype casts and the host reads.

A GPU pays a kernel launch (5-10 µs of host time) per op, a cast is a pass over memory that
computes nothing, and a host read is a device-to-host synchronisation (and an error inside CUDA
graph capture). All three are counted here on any device, a CPU included, by a
``TorchDispatchMode``: one entry per op that the Python code issues, views included, a foreach
op once. Ops that an op decomposes into below the dispatcher's Python key (a CPU foreach op's
per-tensor loop, the ``copy_`` inside ``_to_copy``) are not counted. A TorchFunctionMode would
miss the reads below the Python API (a 0-dim tensor handed to ``torch._foreach_add_`` picks its
Scalar overload, which reads the value in C++); a dispatch mode sees them.

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

__all__ = ["HOST_READ", "DispatchCount", "is_cast", "is_host_read"]

HOST_READ = torch.ops.aten._local_scalar_dense.default
_TO_COPY = torch.ops.aten._to_copy.default
_COPY = torch.ops.aten.copy_.default
_FOREACH_COPY = torch.ops.aten._foreach_copy_.default


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


class DispatchCount(TorchDispatchMode):
    """Inside ``with DispatchCount() as count:``, ``count.ops`` counts aten ops by overload,
    ``count.casts`` the casts by ``"from->to"`` dtypes and ``count.host_reads`` the host reads;
    ``count.read_sites`` and ``count.cast_sites`` say which project lines issued them (the
    deepest ``pixelsac`` frame, else the deepest torch frame)."""

    def __init__(self, sites: bool = True) -> None:
        super().__init__()
        self.sites = sites
        self.ops: collections.Counter = collections.Counter()
        self.casts: collections.Counter = collections.Counter()
        self.reads = 0
        self.read_sites: collections.Counter = collections.Counter()
        self.cast_sites: collections.Counter = collections.Counter()

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
