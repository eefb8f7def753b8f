"""Branching a run: one fp32 checkpoint continued in another arithmetic, or with other random streams.

Two runs started from scratch differ in everything their seeds touch, so a difference in their
returns needs many seeds to tell from noise. Two continuations of one checkpoint share the weights,
the replay and the optimizer's memory; with the same continuation seed they also share every random
stream from the branch point on (environment, exploration, replay sampling, augmentation), so what
differs between an fp16 and an fp32 continuation is the arithmetic of the updates after it
(``tools/branch.py`` runs and compares them).

:func:`branch_checkpoint` turns a pixelsac checkpoint written by an **fp32** run into the checkpoint
of a run in ``precision`` (``fp32``, ``fp16`` or ``bf16``), as if that run had reached the same state:

* weights and the temperature ``log α``: rounded once to the dtype (refused if one overflows);
* Adam's moments ``m``, ``v`` into hAdam's, in the loss scale's units (the scale is never divided
  out): ``exp_avg = S·m`` and ``exp_avg_root = S·c·√v`` with hAdam's ``c = (1-β1)/√(1-β2)``, each
  computed in float64 and rounded once; hAdam's ε the one an fp16 run holds at ``S``
  (``lowp.adam_eps_scaled·S/init_scale``, floored as the scaler floors it); the step count kept.
  bf16 has fp32's range and no loss scaling: there ``S = 1`` and ε is the bf16 run's own;
* the loss scale ``S`` of each loss (fp16): the largest ``init_scale·2^k`` (k <= 0, the scales an fp16 run
  visits) at which no gradient the second moment still remembers would have overflowed: one
  gradient ``g`` adds ``(1-β2)·g²`` to ``v``, so ``|g| <= √(v/(1-β2))`` for every recent ``g``, and
  ``S·max √(v/(1-β2)) <= the dtype's largest value``. The scaler's growth raises it from there
  when the gradients leave room;
* the target critic: its scaled copy ``θ̄_S = K_i·θ̄`` computed from the fp32 target and rounded
  once, with the adaptive scale's shifts for its peaks (:meth:`pixelsac.lowp.KahanEMA.start_from_`);
  compensation buffers zero;
* counters, the replay file and every other callback state as they were.

A ``q_scale`` c moves the run into larger returns' units: the same task with rewards ×c and the
temperature ×c, whose soft Q-function is c times the base's (the soft Bellman equation
``Q = r + γ·E[Q' - α·log π']`` is linear in ``(r, α)``) and whose best policy is the base's.
The fp32 checkpoint is rewritten before any conversion: the last layer of each Q head and of its
target ×c (so every Q the critic outputs is ×c), ``log α += ln c``, ``agent.reward_scale ×c``,
and Adam's moments follow their gradients (``m ×k``, ``v ×k²``): the critic's loss is ×c², so
its gradients are ×c² (k = c²) except in those last layers (k = c, as ``∂Q/∂W`` is unchanged);
the actor's loss ``α·log π - Q`` and the temperature's ``log α·α·E[-log π - H̄]`` are ×c (k = c).
Adam's step ``m/√v`` is unchanged by it (up to ε), so every weight but those last layers steps
as the base's would; the last layers, c times larger, move by the same amount, c times slower
relative to themselves. So a CPU's batch-32 run with Q near 40 reaches the gradients of a run with
Q in the hundreds (what a GPU's batch of 512 trains to), without training that long.

A ``continuation`` seed replaces the random streams the run continues with (the collector's and
environments' generators, torch's and Python's) by ones derived from it; the evaluation's
environment keeps its stream, so every branch is evaluated on the same episodes. Without one the
streams are the checkpoint's: an fp32 branch then continues bit for bit as the run would have.

What cannot be converted is refused in one line (:class:`~pixelsac.checkpoint.CheckpointError`):
a checkpoint of another precision, of several data-parallel ranks, or whose weights or moments
do not fit the dtype at any loss scale.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import numpy as np
import torch

from pixelsac.checkpoint import CheckpointError, callback_state

#: precisions a branch can continue in
BRANCH_PRECISIONS = ("fp32", "fp16", "bf16")
#: mixed into every stream a continuation seed derives, so a branch's streams never equal a run's
BRANCH_STREAM_TAG = 0x6272616E6368  # "branch"


def branch_checkpoint(
    checkpoint: dict[str, Any], precision: str, continuation: int | None = None, q_scale: float = 1.0
) -> dict[str, Any]:
    """The checkpoint of a run in ``precision`` continuing from ``checkpoint`` (an fp32 run's, as
    loaded by :func:`pixelsac.checkpoint.load`), with its Q values ×``q_scale``; see the module
    docstring. ``checkpoint`` is not changed."""
    from pixelsac.module import SACModule

    if precision not in BRANCH_PRECISIONS:
        raise CheckpointError(f"a branch continues in {', '.join(BRANCH_PRECISIONS)}, not {precision!r}")
    config = checkpoint["hyper_parameters"]["config"]
    if config.get("precision") != "fp32":
        raise CheckpointError(
            f"branching starts from an fp32 run's checkpoint; this one was trained in {config.get('precision')}"
        )
    saved = callback_state(checkpoint, "Checkpointer") or {}
    if saved.get("ranks"):
        raise CheckpointError("branching needs a checkpoint of one process; this one holds several data-parallel ranks")
    if not (isinstance(q_scale, (int, float)) and math.isfinite(q_scale) and q_scale > 0):
        raise CheckpointError(f"the Q scale must be a finite number above 0, not {q_scale!r}")
    if q_scale != 1.0:
        checkpoint = scaled_returns(checkpoint, float(q_scale))
        config = checkpoint["hyper_parameters"]["config"]
    out = dict(checkpoint)
    out["hyper_parameters"] = {**checkpoint["hyper_parameters"], "config": {**config, "precision": precision}}
    if precision != "fp32":
        hparams = out["hyper_parameters"]
        module = SACModule(hparams["config"], tuple(hparams["obs_shape"]), int(hparams["action_dim"]))
        scales = _convert_state(checkpoint, module, out)
        out["pixelsac"] = {
            **checkpoint["pixelsac"],
            "skipped": dict.fromkeys(checkpoint["pixelsac"]["skipped"], 0),
            "scalers": {
                loss: {"scale": scale, "clean_steps": 0, "skipped_steps": 0, "taken_steps": 0}
                for loss, scale in scales.items()
            },
        }
    if continuation is not None:
        out["callbacks"] = _reseeded(checkpoint["callbacks"], int(continuation))
    return out


def scaled_returns(checkpoint: dict[str, Any], factor: float) -> dict[str, Any]:
    """The fp32 ``checkpoint`` with rewards, temperature and Q ×``factor`` and Adam's moments in the
    units of the gradients that follow (module docstring); ``checkpoint`` is not changed."""
    from pixelsac.module import LOSSES, SACModule

    hparams = checkpoint["hyper_parameters"]
    config = copy.deepcopy(hparams["config"])
    agent = config["agent"]
    agent["reward_scale"] = float(agent.get("reward_scale", 1.0)) * factor
    module = SACModule(hparams["config"], tuple(hparams["obs_shape"]), int(hparams["action_dim"]))
    names = {id(param): name for name, param in module.named_parameters()}
    last_layers = [f"{head}.{len(getattr(module.critic, head)) - 1}" for head in ("q1", "q2")]  # q1.4, q2.4
    q_outputs = {
        f"{owner}.{layer}.{kind}"
        for owner in ("critic", "critic_target")
        for layer in last_layers
        for kind in ("weight", "bias")
    }
    state = dict(checkpoint["state_dict"])
    for name in q_outputs:
        state[name] = state[name] * factor
    state["log_alpha"] = state["log_alpha"] + math.log(factor)

    def gradient_factor(loss: str, name: str) -> float:
        if loss != "critic":
            return factor  # α·log π - Q, and log α·α·E[-log π - H̄]: ×c
        return factor if name in q_outputs else factor * factor

    stored_states = []
    for loss, optimizer, stored in zip(LOSSES, module.configure_optimizers(), checkpoint["optimizer_states"]):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        moments = {}
        for index, moment in stored["state"].items():
            k = gradient_factor(loss, names[id(params[index])])
            moments[index] = {**moment, "exp_avg": moment["exp_avg"] * k, "exp_avg_sq": moment["exp_avg_sq"] * (k * k)}
        stored_states.append({**stored, "state": moments})
    return {
        **checkpoint,
        "hyper_parameters": {**hparams, "config": config},
        "state_dict": state,
        "optimizer_states": stored_states,
    }


def loss_scale_for(root_moments: list[torch.Tensor], beta2: float, init_scale: float, dtype: torch.dtype) -> float:
    """The largest ``init_scale·2^k`` (integer k <= 0) with ``S·max √v/√(1-β2)`` within ``dtype``
    (see the module docstring); ``root_moments`` are √v in the unscaled units of fp32 Adam."""
    peak = max((float(r.detach().double().max()) for r in root_moments if r.numel()), default=0.0)
    bound = peak / math.sqrt(1.0 - beta2)
    if bound == 0.0:
        return float(init_scale)
    room = torch.finfo(dtype).max / bound
    shift = min(0, math.floor(math.log2(room / init_scale)))
    scale = init_scale * 2.0**shift
    if not scale * bound <= torch.finfo(dtype).max or scale < 2.0**-24:
        raise CheckpointError(
            f"the optimizer remembers gradients up to {bound:.3g}, which {dtype} holds at no loss scale above 2^-24"
        )
    return scale


def _convert_state(checkpoint: dict[str, Any], module: Any, out: dict[str, Any]) -> dict[str, float]:
    """Fill ``out``'s state_dict and optimizer states from ``checkpoint``'s (fp32) for ``module``
    (built in the branch's precision); returns the loss scale chosen for each loss."""
    from pixelsac.module import LOSSES

    state = checkpoint["state_dict"]
    dtype = module.precision_policy.param_dtype
    largest = torch.finfo(dtype).max
    with torch.no_grad():
        for name, param in module.named_parameters():
            value = state[name]
            if not bool(value.abs().max() <= largest):
                raise CheckpointError(f"weight {name} reaches {float(value.abs().max()):.4g}, past {dtype}'s range")
            param.copy_(value)
        updater = module.target_updater
        average = [state[f"critic_target.{name}"] for name in updater.param_names]
        every = int(module.cfg.agent.critic_target_update_every)
        updater.start_from_(average, int(checkpoint["pixelsac"]["updates"]) // every)
    out["state_dict"] = {name: value.detach().clone() for name, value in module.state_dict().items()}

    policy = module.precision_policy
    optimizers = module.configure_optimizers()
    beta1, beta2 = float(module.cfg.agent.beta1), float(module.cfg.agent.beta2)
    root_factor = (1.0 - beta1) / math.sqrt(1.0 - beta2)  # hAdam's s = c·√v (lowp/hadam.py)
    scaler = policy.make_scaler()
    eps_floor = scaler.eps_floor if policy.loss_scaling else 0.0  # where the scaler's rescales stop ε
    scales: dict[str, float] = {}
    converted = []
    for loss, optimizer, stored in zip(LOSSES, optimizers, checkpoint["optimizer_states"]):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        moments = stored["state"]
        roots = [moments[i]["exp_avg_sq"].double().sqrt() for i in range(len(params)) if i in moments]
        scale = loss_scale_for(roots, beta2, policy.init_scale, dtype) if policy.loss_scaling else 1.0
        scales[loss] = scale
        target = optimizer.state_dict()
        for group in target["param_groups"]:
            if policy.loss_scaling:  # ε lives in ×S units, S0 = init_scale
                group["eps"] = max(policy.adam_eps * (scale / policy.init_scale), eps_floor)
        for index in range(len(params)):
            if index not in moments:
                continue
            m, v = moments[index]["exp_avg"].double(), moments[index]["exp_avg_sq"].double()
            exp_avg, exp_avg_root = (m * scale).to(dtype), (v.sqrt() * (root_factor * scale)).to(dtype)
            if not (torch.isfinite(exp_avg).all() and torch.isfinite(exp_avg_root).all()):
                raise CheckpointError(f"the {loss} optimizer's moments overflow {dtype} at loss scale {scale:g}")
            target["state"][index] = {
                "step": int(moments[index]["step"]),
                "exp_avg": exp_avg,
                "exp_avg_root": exp_avg_root,
            }
        optimizer.load_state_dict(target)  # the optimizer's own loader checks the layout
        converted.append(optimizer.state_dict())
    out["optimizer_states"] = converted
    return scales


def _reseeded(callbacks: dict[str, Any], continuation: int) -> dict[str, Any]:
    """Callback states whose training streams derive from ``continuation`` (see the module docstring)."""
    callbacks = copy.deepcopy(callbacks)
    key = next((k for k in callbacks if k == "Checkpointer" or str(k).startswith("Checkpointer{")), None)
    if key is None:
        raise CheckpointError("the checkpoint holds no collector state to reseed (written without its Checkpointer)")
    saved = callbacks[key]
    seeds = np.random.SeedSequence([BRANCH_STREAM_TAG, continuation]).generate_state(4)
    collector = saved["collector"]
    collector["rng"] = np.random.Generator(np.random.PCG64(int(seeds[0]))).bit_generator.state
    env_states = []
    for index, _ in enumerate(collector["env_rngs"]):
        numpy_state = np.random.RandomState(int(seeds[1]) + index).get_state(legacy=False)
        env_states.append(
            {
                "bit_generator": numpy_state["bit_generator"],
                "key": [int(k) for k in numpy_state["state"]["key"]],
                "pos": int(numpy_state["state"]["pos"]),
                "has_gauss": int(numpy_state["has_gauss"]),
                "gauss": float(numpy_state["gauss"]),
            }
        )
    collector["env_rngs"] = env_states
    saved["torch_rng"] = torch.Generator().manual_seed(int(seeds[2])).get_state()
    saved["python_rng"] = random.Random(int(seeds[3])).getstate()
    return callbacks
