"""Counts what reaches torch's dispatcher: every aten op, and the host reads among them.

``aten._local_scalar_dense`` is how every ``.item()``, ``bool()``, ``float()`` and every Scalar
argument built from a tensor reads a value on the host: on CUDA a device-to-host
synchronisation, inside ``torch.cuda.graph`` capture an error. A TorchFunctionMode does not see
the reads that happen below the Python API (a 0-dim tensor handed to ``torch._foreach_add_``
picks its Scalar overload, which reads the value in C++); a TorchDispatchMode does. Ops that an
op decomposes into below the dispatcher's Python key (a CPU foreach op's per-tensor loop) are
not counted: what is counted is one entry per op the Python code issues.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ = torch.ops.aten._local_scalar_dense.default


class DispatchCount(TorchDispatchMode):
    """Inside ``with DispatchCount() as count:``, ``count.ops`` counts aten ops by overload and
    ``count.host_reads`` the host reads; ``count.read_sites`` says which project lines read."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.read_sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        if func is HOST_READ:
            stack = traceback.extract_stack()[:-1]
            # the deepest project line that read, else the deepest torch line (e.g. an optimizer)
            frames = [f for f in stack if "/pixelsac/" in f.filename] or [f for f in stack if "/torch/" in f.filename]
            site = frames[-1] if frames else None
            self.read_sites[f"{site.filename.rsplit('/', 2)[-1]}:{site.lineno}" if site else "?"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def host_reads(self) -> int:
        return self.ops[str(HOST_READ)]

    @property
    def total(self) -> int:
        return sum(self.ops.values())
