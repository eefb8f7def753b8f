"""Data parallelism for SAC's three losses: gradients averaged per backward, without DDP's reducer.

One update backpropagates three losses (critic, actor, temperature), each through its own part of
the module. ``DistributedDataParallel``'s reducer expects every parameter's gradient in every
backward. Lightning's ``ddp_find_unused_parameters_true`` let it search each backward's graph for
the parameters that get none, after which the reducer copies its used-parameter map to the host:
one device synchronisation per backward, three per full update. Its ``broadcast_buffers`` (on by
default) re-sent every buffer from rank 0 before every forward pass -- the Kahan-momentum copy and
its compensation, each the critic's size.

:class:`GradientAverage` keeps Lightning's DDP -- launcher, process group, ranks -- and drops the
wrapper and its reducer:

* at the start of a fit the module's parameters and buffers are broadcast from rank 0, once;
  afterwards no buffer is sent: the buffers (the Kahan-momentum copy and its compensation, the
  counters) are updated identically on every rank from identical, averaged gradients;
* each parameter's post-accumulate-grad hook notes that this backward produced its gradient, and
  right after the backward (``post_backward``, before the loss scaler or optimizer reads it) the
  produced gradients are averaged over the ranks: one all-reduce per dtype, in parameter order.

So each backward averages exactly the gradients it produced -- no graph search, no used-map, no
host read -- including those a loss leaves in another network's parameters (the actor's loss
reaches the critic's heads), which that network's next ``zero_grad`` discards. The all-reduce
follows the backward instead of overlapping it: for DrQ's networks (14 M parameters) one
all-reduce of at most their size per backward.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy


def _coalesced(tensors: Iterable[torch.Tensor], collective: Callable[[torch.Tensor], None]) -> int:
    """Run ``collective`` (in place) on the tensors flattened into one buffer per dtype and
    device, in the order given, and copy the results back (any memory format). Returns the
    number of collectives run."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])  # logical order, whatever the strides
        collective(flat)
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset : offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
    return len(groups)


@torch.no_grad()
def broadcast_states(module: torch.nn.Module, src: int = 0) -> int:
    """Every parameter and buffer of ``module`` from rank ``src`` (coalesced); returns the number
    of broadcasts."""
    tensors = [*module.parameters(), *module.buffers()]
    return _coalesced(tensors, lambda flat: dist.broadcast(flat, src))


@torch.no_grad()
def average_gradients(params: Iterable[torch.Tensor], world_size: int) -> int:
    """``p.grad <- mean over ranks of p.grad`` for each parameter, divided before the sum (as DDP
    does: a 16-bit gradient stays in range); returns the number of all-reduces."""

    def mean(flat: torch.Tensor) -> None:
        flat.div_(world_size)
        dist.all_reduce(flat)

    return _coalesced([p.grad for p in params], mean)


class GradientAverage(DDPStrategy):
    """Lightning's DDP strategy without the DDP wrapper: states broadcast once from rank 0, then
    the gradients each backward produced averaged right after it (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._produced: dict[int, torch.nn.Parameter] = {}
        self._order: dict[int, int] = {}
        self._hooks: list[Any] = []

    def configure_ddp(self) -> None:
        """Called by ``setup`` while fitting, after the module was moved to its device: no wrapper;
        the states from rank 0, and a hook on every trainable parameter."""
        module = self.model
        assert module is not None
        broadcast_states(module)
        params = [p for p in module.parameters() if p.requires_grad]
        self._order = {id(p): i for i, p in enumerate(params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._note) for p in params]

    def _note(self, param: torch.nn.Parameter) -> None:
        self._produced[id(param)] = param

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        self._produced.clear()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        produced = sorted(self._produced.values(), key=lambda p: self._order[id(p)])
        self._produced.clear()
        if produced and self.world_size > 1:
            average_gradients(produced, self.world_size)

    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._order = [], {}
        self._produced.clear()
        super().teardown()


#: What gloo (and NCCL's socket layer) says when the other end of a collective is gone.
_PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer(?: \[[^\]]*\](?::\d+)?)?|Broken pipe")


def lost_rank(exc: BaseException) -> str | None:
    """What to say when ``exc`` is a collective that failed because another rank's process ended
    (killed, out of memory): which rank (the other one of two; the peer's address otherwise) and
    what gloo reported; None for any other error. The ranks come from the process group, or
    where it is gone from the launchers' environment (torchrun's ``RANK``, Lightning's
    ``LOCAL_RANK``, ``WORLD_SIZE``)."""
    if not isinstance(exc, RuntimeError):
        return None
    found = _PEER_GONE.search(str(exc))
    if found is None:
        return None
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        env = os.environ
        rank, world = int(env.get("RANK", env.get("LOCAL_RANK", "0"))), int(env.get("WORLD_SIZE", "0"))
    if world == 2:
        who = f"rank {1 - rank} of the 2 data-parallel ranks"
    else:
        who = f"another of the {world} data-parallel ranks" if world > 2 else "another data-parallel rank"
    return f"{who} ended while rank {rank} waited for it in a collective ({found.group(0).strip()})"
