#!/usr/bin/env python
"""This project's update against the official DrQ update, in one process, interleaved.

    .venv/bin/python tools/fidelity.py drq /path/to/drq [--batch-sizes 128,512] [--rounds 6]

``/path/to/drq`` is a checkout of https://github.com/denisyarats/drq (its ``drq.py``,
``utils.py`` and ``replay_buffer.py`` are imported from there; nothing of it is copied here).
Its module-level imports of hydra, gym and scikit-image are satisfied by small stand-ins at
import time only: the update never touches them.

What runs, for each batch size (DrQ's published agent: 84x84 pixels, 3-frame stack, 32 filters,
feature 50, hidden 1024, K = M = 2, one action dimension as cartpole):

1. **Agreement in float64.** Both agents get the same weights (ours copied into DrQ's networks)
   and the same batch, without augmentation (DrQ's two copies of each observation equal, ours
   with ``agent.aug_pad=0``), the same torch seed before each update; three full updates
   (critic, actor, temperature, target) run in float64 and every weight is compared. The
   largest difference relative to the weight's scale is printed; the tool fails (exit 1) above
   1e-9.
2. **Time.** One timed round is: DrQ's ``DRQAgent.update`` (its own replay sampling, which does
   its augmentation, and the three steps), this project's fp32 update (its replay sampling,
   then ``training_step``), this project's default fp16 update, in turn, each after
   ``--warmup`` untimed updates. Medians over ``--rounds`` rounds and their ratios to DrQ
   are printed and written to ``--out`` (JSON) when given.

The allocator settings in the environment (the Makefile's ``MALLOC_*``) and the thread count are
printed with the results: compare runs only under the same settings.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from judges.common import float64_policy, make_agent, one_update

IMAGE, STACK, ACTION_DIM = 84, 3, 1
OBS_SHAPE = (STACK * 3, IMAGE, IMAGE)
AGREEMENT_TOLERANCE = 1e-9


# --- the DrQ checkout -------------------------------------------------------------------------
def _instantiate(spec: Any, **kwargs: Any) -> Any:
    """hydra.utils.instantiate for DrQ's ``{"class": "drq.Encoder", "params": {...}}`` specs."""
    module_name, _, class_name = spec["class"].rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)(**{**spec["params"], **kwargs})


def _install_stand_ins() -> None:
    """Modules DrQ imports at module level but the update never uses."""
    hydra = types.ModuleType("hydra")
    hydra.utils = types.SimpleNamespace(instantiate=_instantiate)
    hydra.main = lambda *args, **kwargs: lambda fn: fn
    gym = types.ModuleType("gym")
    gym.Wrapper = object
    gym.spaces = types.SimpleNamespace(Box=object)
    skimage = types.ModuleType("skimage")
    skimage_util = types.ModuleType("skimage.util")
    skimage_shape = types.ModuleType("skimage.util.shape")
    skimage_shape.view_as_windows = None
    for name, module in (
        ("hydra", hydra),
        ("gym", gym),
        ("skimage", skimage),
        ("skimage.util", skimage_util),
        ("skimage.util.shape", skimage_shape),
    ):
        sys.modules.setdefault(name, module)


def import_drq(checkout: Path) -> tuple[Any, Any]:
    """DrQ's ``drq`` and ``replay_buffer`` modules from a checkout."""
    missing = [name for name in ("drq.py", "utils.py", "replay_buffer.py") if not (checkout / name).is_file()]
    if missing:
        raise SystemExit(
            f"error: {checkout} is not a denisyarats/drq checkout (missing {', '.join(missing)}); "
            "git clone https://github.com/denisyarats/drq and pass its folder"
        )
    _install_stand_ins()
    sys.path.insert(0, str(checkout))
    return importlib.import_module("drq"), importlib.import_module("replay_buffer")


class _NoLogger:
    """DrQ's update logs histograms and scalars; timing leaves that out on both sides."""

    def log(self, *args: Any, **kwargs: Any) -> None: ...
    def log_histogram(self, *args: Any, **kwargs: Any) -> None: ...
    def log_param(self, *args: Any, **kwargs: Any) -> None: ...
    def log_image(self, *args: Any, **kwargs: Any) -> None: ...


def make_drq_agent(drq: Any, batch_size: int, device: torch.device) -> Any:
    encoder = {"class": "drq.Encoder", "params": {"obs_shape": (STACK * 3, IMAGE, IMAGE), "feature_dim": 50}}
    head = {"encoder_cfg": encoder, "action_shape": (ACTION_DIM,), "hidden_dim": 1024, "hidden_depth": 2}
    return drq.DRQAgent(
        obs_shape=(STACK * 3, IMAGE, IMAGE),
        action_shape=(ACTION_DIM,),
        action_range=(-1.0, 1.0),
        device=device,
        encoder_cfg=encoder,
        critic_cfg={"class": "drq.Critic", "params": head},
        actor_cfg={"class": "drq.Actor", "params": {**head, "log_std_bounds": [-10, 2]}},
        discount=0.99,
        init_temperature=0.1,
        lr=1e-3,
        actor_update_frequency=2,
        critic_tau=0.01,
        critic_target_update_frequency=2,
        batch_size=batch_size,
    )


# --- this project ---------------------------------------------------------------------------
def our_overrides(precision: str, batch_size: int, extra: list[str]) -> list[str]:
    return [
        "task=cartpole_swingup",
        f"precision={precision}",
        f"agent.batch_size={batch_size}",
        f"env.image_size={IMAGE}",
        f"env.frame_stack={STACK}",
        "train.log_every_updates=1000000000",
        *extra,
    ]


def random_replay(batch_size: int, seed: int) -> tuple[Any, np.random.Generator]:
    """This project's replay ring with ``2 * batch_size`` random transitions."""
    from pixelsac.replay import ReplaySet

    rng = np.random.default_rng(seed)
    replay = ReplaySet(1, 2 * batch_size + STACK + 2, (3, IMAGE, IMAGE), np.uint8, STACK, ACTION_DIM)
    replay.buffers[0].add_first(rng.integers(0, 256, (3, IMAGE, IMAGE), dtype=np.uint8))
    for _ in range(2 * batch_size):
        replay.buffers[0].add(
            rng.uniform(-1, 1, ACTION_DIM).astype(np.float32),
            float(rng.uniform()),
            False,
            rng.integers(0, 256, (3, IMAGE, IMAGE), dtype=np.uint8),
        )
    return replay, rng


def drq_replay(replay_module: Any, batch_size: int, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    buffer = replay_module.ReplayBuffer((STACK * 3, IMAGE, IMAGE), (ACTION_DIM,), 2 * batch_size, 4, "cpu")
    for _ in range(2 * batch_size):
        obs = rng.integers(0, 256, (STACK * 3, IMAGE, IMAGE), dtype=np.uint8)
        buffer.add(
            obs,
            rng.uniform(-1, 1, ACTION_DIM),
            float(rng.uniform()),
            rng.integers(0, 256, (STACK * 3, IMAGE, IMAGE), dtype=np.uint8),
            False,
            False,
        )
    return buffer


# --- 1. agreement in float64 ----------------------------------------------------------------
def _pairs(ours: Any, theirs: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, our tensor, DrQ's tensor) for every weight both agents keep."""
    pairs = [("log_alpha", ours.log_alpha, theirs.log_alpha)]
    for side, our_critic, drq_critic in (
        ("critic", ours.critic, theirs.critic),
        ("critic_target", ours.critic_target, theirs.critic_target),
    ):
        convs = [m for m in our_critic.trunk.convs if isinstance(m, torch.nn.Conv2d)]
        for i, conv in enumerate(convs):
            pairs += [
                (f"{side}.conv{i}.weight", conv.weight, drq_critic.encoder.convs[i].weight),
                (f"{side}.conv{i}.bias", conv.bias, drq_critic.encoder.convs[i].bias),
            ]
        for ours_part, drq_part, name in (
            (our_critic.proj.net[0], drq_critic.encoder.head[0], "fc"),
            (our_critic.proj.net[1], drq_critic.encoder.head[1], "ln"),
        ):
            pairs += [
                (f"{side}.{name}.weight", ours_part.weight, drq_part.weight),
                (f"{side}.{name}.bias", ours_part.bias, drq_part.bias),
            ]
        for q_ours, q_drq, q in ((our_critic.q1, drq_critic.Q1, "q1"), (our_critic.q2, drq_critic.Q2, "q2")):
            for i, layer in enumerate(q_ours):
                if isinstance(layer, torch.nn.Linear):
                    pairs += [
                        (f"{side}.{q}.{i}.weight", layer.weight, q_drq[i].weight),
                        (f"{side}.{q}.{i}.bias", layer.bias, q_drq[i].bias),
                    ]
    for ours_part, drq_part, name in (
        (ours.actor.proj.net[0], theirs.actor.encoder.head[0], "fc"),
        (ours.actor.proj.net[1], theirs.actor.encoder.head[1], "ln"),
    ):
        pairs += [
            (f"actor.{name}.weight", ours_part.weight, drq_part.weight),
            (f"actor.{name}.bias", ours_part.bias, drq_part.bias),
        ]
    for i, layer in enumerate(ours.actor.policy):
        if isinstance(layer, torch.nn.Linear):
            pairs += [
                (f"actor.policy.{i}.weight", layer.weight, theirs.actor.trunk[i].weight),
                (f"actor.policy.{i}.bias", layer.bias, theirs.actor.trunk[i].bias),
            ]
    return pairs


class _FixedBatch:
    """A stand-in for DrQ's replay buffer that returns one batch, its augmented copies equal to it."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        b = self.batch
        obs, next_obs = b["obs"].double(), b["next_obs"].double()
        return (
            obs,
            b["action"].double(),
            b["reward"].double(),
            next_obs,
            b["not_terminal"].double(),
            obs.clone(),
            next_obs.clone(),
        )


def check_float64_agreement(drq: Any, batch_size: int, updates: int = 3) -> float:
    """Largest |ours - DrQ| / (max |DrQ| + 1e-12) over every weight after ``updates`` float64 updates."""
    from pixelsac.perf import synthetic_batch

    torch.manual_seed(0)
    theirs = make_drq_agent(drq, batch_size, torch.device("cpu"))
    ours = make_agent(
        our_overrides("fp32", batch_size, ["agent.aug_pad=0", "perf.channels_last=false", "lowp.derived_target=false"]),
        OBS_SHAPE,
        ACTION_DIM,
    )
    ours.double()
    ours.precision_policy = float64_policy(ours.precision_policy)
    for module in (theirs.actor, theirs.critic, theirs.critic_target):
        module.double()
    with torch.no_grad():
        theirs.log_alpha = theirs.log_alpha.double().detach().requires_grad_(True)
        for _, mine, other in _pairs(ours, theirs):
            other.copy_(mine)
    # DrQ's optimizers were built on the float32 tensors: rebuild them on the float64 ones
    theirs.actor_optimizer = torch.optim.Adam(theirs.actor.parameters(), lr=1e-3)
    theirs.critic_optimizer = torch.optim.Adam(theirs.critic.parameters(), lr=1e-3)
    theirs.log_alpha_optimizer = torch.optim.Adam([theirs.log_alpha], lr=1e-3)
    logger = _NoLogger()
    for step in range(updates):
        batch = synthetic_batch(batch_size, (STACK * 3, IMAGE, IMAGE), ACTION_DIM, seed=step)
        torch.manual_seed(100 + step)
        theirs.update(_FixedBatch(batch), logger, step)
        torch.manual_seed(100 + step)
        one_update(ours, batch)
    worst = 0.0
    for _name, mine, other in _pairs(ours, theirs):
        scale = float(other.detach().abs().max()) + 1e-12
        worst = max(worst, float((mine.detach() - other.detach()).abs().max()) / scale)
    return worst


# --- 2. time ------------------------------------------------------------------------------
def time_side_by_side(
    drq: Any, replay_module: Any, batch_size: int, rounds: int, warmup: int, with_fp16: bool
) -> dict[str, list[float]]:
    torch.manual_seed(1)
    theirs = make_drq_agent(drq, batch_size, torch.device("cpu"))
    their_replay = drq_replay(replay_module, batch_size, seed=1)
    contenders: dict[str, Any] = {"drq": lambda step: theirs.update(their_replay, _NoLogger(), step)}
    for precision in ("fp32", "fp16") if with_fp16 else ("fp32",):
        module = make_agent(our_overrides(precision, batch_size, []), OBS_SHAPE, ACTION_DIM)
        replay, rng = random_replay(batch_size, seed=2)
        contenders[f"ours_{precision}"] = lambda step, module=module, replay=replay, rng=rng: one_update(
            module, replay.sample(batch_size, rng)
        )
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for step in range(warmup + rounds):
        for name, update in contenders.items():
            start = time.perf_counter()
            update(step)
            if step >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/fidelity.py drq", description=__doc__.split("\n\n")[0])
    parser.add_argument("drq", type=Path, help="a checkout of github.com/denisyarats/drq")
    parser.add_argument("--batch-sizes", default="128,512")
    parser.add_argument("--rounds", type=int, default=6, help="timed updates of each contender per batch size")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-fp16", action="store_true", help="time fp32 only")
    parser.add_argument("--skip-check", action="store_true", help="skip the float64 agreement check")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    drq, replay_module = import_drq(args.drq.resolve())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    settings = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
        f"allocator: {' '.join(f'{k}={v}' for k, v in sorted(settings.items())) or 'glibc defaults'}"
    )
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "allocator": settings,
        "batch_sizes": {},
    }
    failed = False
    if not args.skip_check:
        worst = check_float64_agreement(drq, batch_size=16)
        failed = not worst <= AGREEMENT_TOLERANCE
        print(
            f"float64, 3 updates, batch 16: largest weight difference to DrQ {worst:.2e} of the weight's scale "
            f"({'FAIL' if failed else 'ok'}: tolerance {AGREEMENT_TOLERANCE:g})"
        )
        results["float64_relative_difference"] = worst
    for batch_size in batch_sizes:
        times = time_side_by_side(drq, replay_module, batch_size, args.rounds, args.warmup, not args.no_fp16)
        medians = {name: statistics.median(ms) for name, ms in times.items()}
        results["batch_sizes"][batch_size] = {"ms": times, "median_ms": medians}
        line = ", ".join(f"{name} {ms:.0f} ms ({ms / medians['drq']:.2f}x DrQ)" for name, ms in medians.items())
        print(f"batch {batch_size}: {line}")
        if "ours_fp16" in medians:
            print(f"batch {batch_size}: ours fp16 / ours fp32 = {medians['ours_fp16'] / medians['ours_fp32']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 1 if failed else 0
