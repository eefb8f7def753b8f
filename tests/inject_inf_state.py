"""Test helper: run pixelsac.train, but after the critic optimizer's 6th step overwrite one
element of its root second moment with inf -- a state the optimizer itself never writes (it
skips such steps) -- so the test can check that the health check stops the run with exit 3."""

import sys

import torch

from pixelsac.lowp import HAdam

real_step = HAdam.step
calls: dict[int, int] = {}


def step_then_poison(self, *args, **kwargs):
    result = real_step(self, *args, **kwargs)
    calls[id(self)] = calls.get(id(self), 0) + 1
    first_state = next(iter(self.state.values()), None)
    if calls[id(self)] == 6 and first_state is not None and first_state["exp_avg_root"].numel() > 1:
        with torch.no_grad():
            root = first_state["exp_avg_root"]
            root[(0,) * root.dim()] = float("inf")  # any layout (channels-last conv weights)
    return result


HAdam.step = step_then_poison

from pixelsac.train import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
