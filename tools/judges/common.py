"""What the float64 judges of ``tools/fidelity.py`` share: a run's saved state read back, its
losses under one seeded stream of noise, agents driven through Lightning Fabric the way the
Trainer drives them, float64 as a precision policy, and weights as one flat float64 vector."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pixelsac import checkpoint as ckpt_io
from pixelsac.module import LOSSES, SACModule
from pixelsac.replay import ReplaySet


class RunUnreadable(Exception):
    """A run directory without a readable ``last.ckpt`` or the replay saved beside it: one line
    for the user (the tools exit 2)."""


def load_run(run_dir: Path) -> tuple[SACModule, ReplaySet, dict[str, Any]]:
    """The module, the replay and the checkpoint of ``run_dir``'s ``last.ckpt``; raises
    :class:`RunUnreadable` when either cannot be read. The module shifts by index, whose integer
    shifts are the same in every dtype, so a float64 copy of it sees the same pixels."""
    try:
        checkpoint = ckpt_io.load(run_dir, prefer="last")
    except (OSError, ckpt_io.CheckpointError) as exc:
        raise RunUnreadable(str(exc)) from None
    module = SACModule.from_checkpoint(checkpoint)
    module.augment.backend = "index"
    cfg = module.cfg
    replay_file = None
    for state in checkpoint.get("callbacks", {}).values():
        if isinstance(state, dict) and state.get("replay_file"):
            replay_file = state["replay_file"]
    if replay_file is None:
        raise RunUnreadable(f"{run_dir}'s last.ckpt names no replay file (checkpoint.save_replay was off)")
    try:
        state = torch.load(run_dir / "checkpoints" / replay_file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise RunUnreadable(f"cannot read the replay {replay_file} beside {run_dir}'s last.ckpt: {exc}") from None
    frame_shape = (module.obs_shape[0] // cfg.env.frame_stack, *module.obs_shape[1:])
    replay = ReplaySet(
        len(state["buffers"]), cfg.replay.capacity, frame_shape, np.uint8, cfg.env.frame_stack, module.action_dim
    )
    replay.load_state_dict(state)
    return module, replay, checkpoint


@contextlib.contextmanager
def shared_noise(seed: int):
    """torch.randn draws float32 normals from one seeded stream and casts them to the dtype asked
    for: every precision gets the same noise (rounded to its dtype), float64 gets it unrounded."""
    original = torch.randn
    generator = torch.Generator().manual_seed(seed)

    def randn(*size: Any, dtype: torch.dtype | None = None, device: Any = None, **kwargs: Any) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return original(shape, generator=generator, dtype=torch.float32).to(dtype=dtype or torch.float32)

    torch.randn = randn
    try:
        yield
    finally:
        torch.randn = original


def losses(
    module: SACModule, batch: dict[str, torch.Tensor], seed: int
) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Per loss (critic, actor, alpha): the loss on ``batch`` as the module computes it, with the
    augmentation shifts and policy noise of ``seed`` (:func:`shared_noise`), and the parameters it
    trains by name."""
    policy, agent = module.precision_policy, module.cfg.agent
    torch.manual_seed(seed)  # the augmentation's shifts (integers: the same in every dtype)
    with shared_noise(seed):
        next_aug = policy.cast_observation(module.augment.copies(batch["next_obs"], agent.aug_target_copies))
        obs_aug = policy.cast_observation(module.augment.copies(batch["obs"], agent.aug_q_copies))
        action, reward, not_terminal = (policy.cast_input(batch[k]) for k in ("action", "reward", "not_terminal"))
        with policy.compute_context():
            critic_loss, _ = module.critic_loss(obs_aug, action, reward, not_terminal, next_aug)
            actor_loss, alpha_loss, _ = module.actor_and_alpha_loss(obs_aug[: action.shape[0]])
    return {
        "critic": (critic_loss, {f"critic.{n}": p for n, p in module.critic.named_parameters()}),
        "actor": (actor_loss, {f"actor.{n}": p for n, p in module.actor.named_parameters()}),
        "alpha": (alpha_loss, {"log_alpha": module.log_alpha}),
    }


def run_scales(checkpoint: dict[str, Any]) -> dict[str, float]:
    """Each loss's scale as the checkpoint's scalers hold it (1.0 for a loss without one)."""
    saved = checkpoint.get("pixelsac", {}).get("scalers", {})
    return {name: float(saved[name]["scale"]) if name in saved else 1.0 for name in LOSSES}


def float64_policy(policy: Any) -> Any:
    """``policy`` (a PrecisionPolicy) with every dtype float64: the judge's machinery is fp32's."""
    from pixelsac import precision

    judge = dataclasses.make_dataclass("Float64Policy", [], bases=(precision.PrecisionPolicy,), frozen=True)
    judge.param_dtype = property(lambda self: torch.float64)
    return judge(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(precision.PrecisionPolicy)})


def driven_by_fabric(module: SACModule, load_states: Callable[[list[Any]], None] | None = None) -> Any:
    """``module`` set up as the Trainer would, driven through Lightning Fabric (one CPU process), so
    that several agents can take turns in one loop: Fabric's wrapper of it (``.module``).
    ``load_states`` receives the optimizers before Fabric wraps them (a resume loads their state)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    module._fabric = fabric  # what Fabric.setup does; setup() below needs it before the optimizers exist
    module.setup("fit")
    optimizers = module.configure_optimizers()
    if load_states is not None:
        load_states(optimizers)
    # not module.on_fit_start(): it prepares a checkpoint's restore through trainer.optimizers,
    # which a Fabric-driven module lacks (a resume restores the scalers itself)
    wrapped, *_ = fabric.setup(module, *optimizers)
    return wrapped


def make_agent(overrides: list[str], obs_shape: tuple[int, ...], action_dim: int) -> Any:
    """A fresh agent of the config ``overrides`` give, driven by :func:`driven_by_fabric`."""
    from pixelsac.config import load_config, to_plain

    return driven_by_fabric(SACModule(to_plain(load_config(overrides)), obs_shape, action_dim))


def one_update(module: Any, batch: dict[str, torch.Tensor]) -> None:
    """One full update (critic, actor and temperature, target) on ``batch``, as training takes it."""
    module.training_step(iter([(batch, 0, 0)]))


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one float64 vector (exact: every 16- and 32-bit value is a float64)."""
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])
